"""Embed a corpus once into a stale buffer: `accelerate launch scripts/embed_corpus.py --config FILE [key=value ...]`.

Rerun the same command to resume a killed build; see rag_train.serving.embed_corpus.EmbedConfig for the keys.
"""

from rag_train.cli import exit_on_fault, parse_cli
from rag_train.serving.embed_corpus import EmbedConfig, embed_corpus
from rag_train.launch import make_accelerator


def main(argv=None) -> None:
    cfg = parse_cli(EmbedConfig, argv, description=__doc__)
    with exit_on_fault():  # `error: <file, line, field>` and exit status 2 on bad input
        accelerator = make_accelerator(timeout_s=cfg.collective_timeout)
        buffer = embed_corpus(cfg, accelerator)
    if accelerator.is_main_process:
        print(f"buffer: {buffer.path} ({buffer.rows} rows x {buffer.dim}, {buffer.dtype}; "
              f"{accelerator.num_processes} process(es))")
    accelerator.wait_for_everyone()
    accelerator.state.destroy_process_group()  # clean exit of a multi-process run


if __name__ == "__main__":
    main()

"""Embed a corpus once into a stale buffer: `accelerate launch scripts/embed_corpus.py --config FILE [key=value ...]`.

Rerun the same command to resume a killed build; see rag_train.config.EmbedConfig for the keys.
"""

from accelerate import Accelerator

from rag_train.buffer.build import embed_corpus
from rag_train.config import EmbedConfig, parse_cli


def main(argv=None) -> None:
    cfg = parse_cli(EmbedConfig, argv, description=__doc__)
    accelerator = Accelerator()
    buffer = embed_corpus(cfg, accelerator)
    if accelerator.is_main_process:
        print(f"buffer: {buffer.path} ({buffer.rows} rows x {buffer.dim}, {buffer.dtype})")


if __name__ == "__main__":
    main()

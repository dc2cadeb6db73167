"""Embedding a corpus once into a stale buffer, the recipe behind scripts/embed_corpus.py: its config schema
and the driver that resolves the corpus and the model and calls `rag_train.buffer.build.build_buffer`, as the one
writer of its output folder, stopping at a shard boundary on SIGTERM / SIGUSR1."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rag_train.buffer.build import build_buffer
from rag_train.buffer.embed import CorpusPasses, PassageTokenizer, use_token_cache
from rag_train.buffer.store import Buffer
from rag_train.buffer.tokens import build_token_cache, token_cache_dir
from rag_train.config import BufferConfig, ConfigError, DataConfig, RetrieverConfig, check_positive
from rag_train.data.corpus import Corpus
from rag_train.launch import make_accelerator
from rag_train.models.retriever import DualEncoder
from rag_train.preemption import StopSignal
from rag_train.train.run_dir import lock_run_directory


@dataclass
class EmbedConfig:
    """scripts/embed_corpus.py: embed a corpus once into a stale buffer (multi-process, resumable).

    The buffer goes to `output` (default `buffer.path`); rerunning the same command resumes a killed or stopped
    build (SIGTERM / SIGUSR1 stop it at the next shard boundary, exit 6). Embeds with a saved DualEncoder
    (`model_dir`) or with `retriever` built from its config. A complete buffer already there is reused after its
    shards pass their sha256 (`buffer.verify`); a damaged one is an error naming the shard unless `repair`. With
    `buffer.token_cache` the corpus's token ids go to `<output>.tokens` first (buffer/tokens.py) and the build reads
    them; a training run whose `buffer.path` is `output` then reuses them.
    """

    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    passages: Optional[str] = None  # corpus to embed; default data.passages or the toy world's
    output: Optional[str] = None  # buffer directory; default buffer.path
    model_dir: Optional[str] = None  # a DualEncoder.save folder (e.g. a trained retriever)
    seed: int = 0  # init seed of `tiny` models: equal to the training run's so its buffer matches
    overwrite: bool = False  # replace a complete buffer (and token cache) of another model / corpus in `output`
    # re-encode only the shards of `output` that fail their sha256, and rebuild an unreadable manifest from the
    # shards' own records (shard-NNNNN.json), keeping every intact shard
    repair: bool = False
    collective_timeout: int = 1800  # seconds a collective waits for the other processes (see train.collective_timeout)

    def __post_init__(self) -> None:
        check_positive("", "collective_timeout", self.collective_timeout)
        check_positive("", "seed", self.seed, allow_zero=True)
        if self.output is None and self.buffer.path is None:
            raise ConfigError("embed: set output=DIR (or buffer.path=DIR) for the buffer")


def embed_corpus(cfg: EmbedConfig, accelerator=None, stop: Optional[StopSignal] = None) -> Buffer:
    """Resolve corpus and model from an EmbedConfig and build the buffer (scripts/embed_corpus.py's work), holding
    the output folder's lock (`<output>/.lock`: a second build there would remove the first one's temporary files
    and write its manifest under it), taken once the inputs have loaded. `stop`: see `build_buffer` (the token cache
    built first stops the same way)."""
    accelerator = accelerator or make_accelerator()
    passages, tokenizer = cfg.passages or cfg.data.passages, cfg.retriever.tokenizer
    needs_toy_tokenizer = cfg.model_dir is None and cfg.retriever.model == "tiny" and tokenizer is None
    if cfg.data.toy and (passages is None or needs_toy_tokenizer):
        from rag_train.data.toy_files import ensure_toy_world

        with accelerator.main_process_first():
            files = ensure_toy_world(cfg.data)
        passages, tokenizer = passages or str(files["passages"]), tokenizer or str(files["tokenizer"])
    if passages is None:
        raise ConfigError("embed: no corpus; set passages=FILE (or data.passages=FILE, or data.toy=true)")
    with accelerator.main_process_first():  # the main process builds the corpus index once
        corpus = Corpus.open(passages)
    if cfg.model_dir is not None:
        model = DualEncoder.load(cfg.model_dir)
    else:
        model = DualEncoder.from_config(cfg.retriever, tokenizer, seed=cfg.seed)
    out_dir = Path(cfg.output or cfg.buffer.path)
    made = not out_dir.exists()
    lock = lock_run_directory(out_dir, "embedding a corpus (embed_corpus)", accelerator)
    try:
        passes = CorpusPasses(accelerator.print)
        with contextlib.ExitStack() as registered:
            if cfg.buffer.token_cache:  # beside the buffer: runs that name it as buffer.path tokenise no more
                registered.enter_context(use_token_cache(build_token_cache(
                    corpus, PassageTokenizer.for_passages(model), token_cache_dir(out_dir),
                    shard_rows=cfg.buffer.shard_rows, num_workers=cfg.buffer.embed_workers, accelerator=accelerator,
                    overwrite=cfg.overwrite, passes=passes, stop=stop)))
            return build_buffer(model, corpus, out_dir, batch_size=cfg.buffer.embed_batch_size,
                                shard_rows=cfg.buffer.shard_rows, dtype=cfg.buffer.dtype, accelerator=accelerator,
                                overwrite=cfg.overwrite, num_workers=cfg.buffer.embed_workers,
                                batch_tokens=cfg.buffer.embed_batch_tokens, passes=passes,
                                verify=cfg.buffer.verify, repair=cfg.repair, stop=stop)
    finally:
        if lock is not None:
            lock.release()
            if made and out_dir.is_dir() and not any(out_dir.iterdir()):  # nothing written: the lock's folder goes
                out_dir.rmdir()


def embed_corpus_recipe(cfg: EmbedConfig) -> dict:
    """`scripts/embed_corpus.py` (through `rag_train.cli.run_recipe`): the buffer embedded (or resumed) by every
    process of the launch; returns what the summary prints. A stop signal from the start on is noted, not obeyed:
    the build stops at its next shard boundary (Preempted: exit 6)."""
    stop = StopSignal()
    try:
        accelerator = make_accelerator(timeout_s=cfg.collective_timeout)
        buffer = embed_corpus(cfg, accelerator, stop)
        accelerator.wait_for_everyone()  # every shard written before any process ends the group
    finally:
        stop.restore()
    return {"path": str(buffer.path), "rows": buffer.rows, "dim": buffer.dim, "dtype": str(buffer.dtype),
            "processes": accelerator.num_processes, "main": accelerator.is_main_process}


def print_buffer_summary(cfg: EmbedConfig, result: dict) -> None:
    if result["main"]:
        print(f"buffer: {result['path']} ({result['rows']} rows x {result['dim']}, {result['dtype']}; "
              f"{result['processes']} process(es))")

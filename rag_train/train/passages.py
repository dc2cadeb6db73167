"""The passages both recipes' steps work with: the stale buffer B built at step 0 (`ensure_buffer`), the corpus's
token ids that every corpus pass reads (`ensure_token_cache`), and a passage set sharded over processes with gradients
flowing back through the gather (`my_share`, `gather_with_grad`)."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from rag_train.buffer.build import build_buffer
from rag_train.buffer.embed import PassageTokenizer, use_token_cache
from rag_train.buffer.store import MANIFEST, Buffer, BufferError, vectors_fingerprint
from rag_train.buffer.tokens import build_token_cache, token_cache_dir
from rag_train.config import BufferConfig
from rag_train.data.corpus import Corpus
from rag_train.preemption import Preempted
from rag_train.train.run import TrainingRun

RESUME_HINT = " (a training run: with train.resume=true)"  # the same command alone is refused: the run's folder
# already holds this run


def buffer_dir(run: TrainingRun, cfg: BufferConfig) -> Path:
    """The run's stale buffer folder: `buffer.path`, else its own."""
    return Path(cfg.path) if cfg.path else run.dir / "buffer"


def ensure_token_cache(run: TrainingRun, cfg: BufferConfig, model: nn.Module, corpus: Corpus) -> None:
    """With `buffer.token_cache`, tokenise the corpus once for `model`'s passage tower into `<buffer>.tokens` beside
    the buffer folder (or reuse the cache there) and register it for the rest of the run: every corpus pass (buffer
    build, refreshes, re-embedding strategies, evaluations) then reads its ids. The run's own cache is rebuilt when
    it is of another corpus or tokenizer; one beside a named `buffer.path` is never overwritten (refused, naming
    the field). A stop signal during the build stops it at a shard boundary (Preempted), the finished shards kept for
    the resumed run."""
    if not cfg.token_cache:
        return
    try:
        cache = build_token_cache(corpus, PassageTokenizer.for_passages(model), token_cache_dir(buffer_dir(run, cfg)),
                                  shard_rows=cfg.shard_rows, num_workers=cfg.embed_workers,
                                  accelerator=run.accelerator, overwrite=cfg.path is None, passes=run.passes,
                                  stop=run.stop_signal)
    except Preempted as exc:
        raise Preempted(f"{exc}{RESUME_HINT}") from exc
    run.registered.enter_context(use_token_cache(cache))


def ensure_buffer(run: TrainingRun, cfg: BufferConfig, model: nn.Module, corpus: Corpus) -> Path:
    """The stale buffer B = g(Y; Theta_0): built with the initial model unless a complete one exists.

    A buffer must match this corpus and this initial model (`vectors_fingerprint`: weights, pooling,
    normalisation, lengths, tokenizer) and dtype, at a fresh start and when resuming alike (a `buffer.path`
    of another model is refused, naming both fingerprints). Before the build
    every process must hold the same corpus and initial model; after it, the same manifest, and (with
    `buffer.verify`) every shard's sha256 is checked, each process hashing its share. A stop signal during the build
    stops it at a shard boundary (Preempted), the finished shards kept for the resumed run."""
    directory = buffer_dir(run, cfg)
    acc = run.accelerator
    if run.latest_checkpoint() is not None:  # resuming: `model` is the initial model, the buffer must be its
        buffer = Buffer.open(directory, model_fingerprint=vectors_fingerprint(model),
                             corpus_fingerprint=corpus.fingerprint)
        if buffer.dtype != cfg.dtype:
            raise BufferError(f"{directory / MANIFEST}: field 'dtype': {buffer.dtype!r}, "
                              f"but buffer.dtype={cfg.dtype!r}")
    else:
        run.agree(corpus_fingerprint=corpus.fingerprint, initial_model=model.fingerprint())
        # A user-named buffer is reused when it matches and never overwritten; the run's own is rebuilt.
        try:
            buffer = build_buffer(model, corpus, directory, batch_size=cfg.embed_batch_size,
                                  shard_rows=cfg.shard_rows, dtype=cfg.dtype, accelerator=acc,
                                  overwrite=cfg.path is None, num_workers=cfg.embed_workers,
                                  batch_tokens=cfg.embed_batch_tokens, passes=run.passes, stop=run.stop_signal)
        except Preempted as exc:
            raise Preempted(f"{exc}{RESUME_HINT}") from exc
    run.check_buffer(directory)
    if cfg.verify:
        buffer.verify(acc.process_index, acc.num_processes)
    return directory


def my_share(rows: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
    """This process's contiguous part of a passage set (padded by repeating the last row so every process
    encodes the same number; `gather_with_grad` drops the padding)."""
    world = accelerator.num_processes
    if world == 1:
        return rows
    per_rank = -(-len(rows) // world)
    padded = torch.cat([rows, rows[-1:].expand(per_rank * world - len(rows))])
    return padded[accelerator.process_index * per_rank : (accelerator.process_index + 1) * per_rank]


def gather_with_grad(part: torch.Tensor, total: int, accelerator: Accelerator) -> torch.Tensor:
    """All processes' parts concatenated, gradient flowing back to each owner (all_gather's backward
    sums the gradients from every process), with the padding of `my_share` removed."""
    if accelerator.num_processes == 1:
        return part
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(part.contiguous()))[:total]

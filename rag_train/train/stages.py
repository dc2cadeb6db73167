"""Pieces of a training step shared by both recipes: the stale buffer at step 0, and sharding a passage
set over processes with gradients flowing back through the gather."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from rag_train.buffer.build import build_buffer
from rag_train.buffer.store import Buffer
from rag_train.config import BufferConfig
from rag_train.data.corpus import Corpus
from rag_train.train.common import TrainingRun


def ensure_buffer(run: TrainingRun, cfg: BufferConfig, model: nn.Module, corpus: Corpus) -> Path:
    """The stale buffer B = g(Y; Theta_0): built with the initial model unless a complete one exists.

    A buffer named by `buffer.path` must match this corpus (and, at a fresh start, this model); the run's
    own buffer is reused as is when resuming (it was built from the run's initial model). Before the build
    every process must hold the same corpus and initial model; after it, the same manifest, and (with
    `buffer.verify`) every shard's sha256 is checked, each process hashing its share."""
    directory = Path(cfg.path) if cfg.path else run.dir / "buffer"
    acc = run.accelerator
    if run.latest_checkpoint() is not None:  # resuming: the buffer of this run's initial model, as it is
        buffer = Buffer.open(directory, corpus_fingerprint=corpus.fingerprint)
    else:
        run.agree(corpus_fingerprint=corpus.fingerprint, initial_model=model.fingerprint())
        # A user-named buffer is reused when it matches and never overwritten; the run's own is rebuilt.
        buffer = build_buffer(model, corpus, directory, batch_size=cfg.embed_batch_size, shard_rows=cfg.shard_rows,
                              dtype=cfg.dtype, accelerator=acc, overwrite=cfg.path is None,
                              num_workers=cfg.embed_workers, batch_tokens=cfg.embed_batch_tokens, passes=run.passes)
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

"""Strategies that search the stale buffer: stale, frozen, exhaustive refresh, SNM, uniform, closed book."""

from __future__ import annotations

import numpy as np
import torch

from rag_train.buffer.search import build_faiss_index
from rag_train.buffer.store import Buffer
from rag_train.strategies.base import IndexedStrategy, Strategy, StrategyContext, read_rows
from rag_train.config import StrategyConfig


def search_device(ctx: StrategyContext) -> torch.device:
    wanted = ctx.buffer_cfg.device
    if wanted == "auto":
        return ctx.accelerator.device
    return torch.device(wanted)


class Uniform(Strategy):
    """Uniformly random passages (Alg. 1: uniform negatives only; Alg. 2: k random passages per question)."""

    def retrieve_global(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        batch = queries.shape[0] * self.ctx.accelerator.num_processes
        return self.uniform_rows(batch * k).reshape(batch, k)


class ClosedBook(Strategy):
    """The reader sees the question only: the lower bound on what retrieval adds."""

    retrieves = False
    trains_retriever = False


class Stale(IndexedStrategy):
    """Top-k of <f(x), B> over the buffer embedded at step 0, never refreshed; the encoders still train."""

    needs_buffer = True

    def __init__(self, cfg: StrategyConfig, ctx: StrategyContext):
        super().__init__(cfg, ctx)
        if ctx.buffer_dir is None:
            raise ValueError(f"strategy {cfg.name!r} needs a stale buffer (buffer.path or a built run buffer)")
        self.buffer = Buffer.open(ctx.buffer_dir)
        self.build_index()

    def build_index(self) -> None:
        """This process's rows of the stale buffer: fp32 in memory on CPU, the buffer dtype on an accelerator,
        or — for corrector_rerank, meant for buffers that do not fit device memory — left memory-mapped
        behind a FAISS candidate index built once here."""
        start, end = self.local_range(self.buffer.rows)
        self.row_offset = start
        if self.search_mode == "corrector_rerank":
            self.vectors = self.buffer.shard(start, end)
            self.faiss_index = build_faiss_index(self.vectors, self.ctx.buffer_cfg.faiss_index, self.ctx.buffer_cfg.chunk_rows)
            return
        device = search_device(self.ctx)
        rows = self.buffer.tensor(start, end)
        self.vectors = rows.to(device, torch.float32 if device.type == "cpu" else rows.dtype)

    def stale_vectors(self, rows: torch.Tensor) -> torch.Tensor:
        """B[rows] for arbitrary global rows, fp32 (read from the memmapped buffer, not the local shard)."""
        return read_rows(self.buffer, rows)


class Frozen(Stale):
    """RLM baseline: passages from the stale buffer with a retriever that is never trained."""

    trains_retriever = False


class Exhaustive(Stale):
    """Stale, plus re-embedding the whole buffer with the current passage encoder every R steps.
    Each process re-embeds its own rows, so the cost is split across processes."""

    def after_step(self, step: int) -> None:
        super().after_step(step)
        if step % self.cfg.refresh_every == 0:
            start, end = self.row_offset, self.row_offset + len(self.vectors)
            fresh = self.embed(np.arange(start, end))
            self.vectors = fresh.to(self.vectors.device, self.vectors.dtype)
            self.embedded += self.buffer.rows

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(super().state_tensors(), vectors=self.vectors)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.vectors = tensors["vectors"].to(self.vectors.device, self.vectors.dtype)


class SNM(Stale):
    """Stochastic negative mining: search a uniform sample of M targets, re-sampled and re-embedded
    every R steps. The first sample takes its vectors from the stale buffer (embedded at step 0)."""

    def build_index(self) -> None:
        self.resample(reembed=False)

    def resample(self, reembed: bool) -> None:
        total = self.buffer.rows
        size = min(self.cfg.snm_targets, total)
        self.index_rows = torch.randperm(total, generator=self.generator)[:size].sort().values
        start, end = self.local_range(size)
        self.row_offset = start
        mine = self.index_rows[start:end]
        if reembed:
            self.vectors = self.embed(mine.numpy()).to(search_device(self.ctx))
            self.embedded += size
        else:
            self.vectors = self.stale_vectors(mine).to(search_device(self.ctx))

    def after_step(self, step: int) -> None:
        super().after_step(step)
        if step % self.cfg.refresh_every == 0:
            self.resample(reembed=True)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(super().state_tensors(), vectors=self.vectors, index_rows=self.index_rows)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.index_rows = tensors["index_rows"]
        start, _ = self.local_range(len(self.index_rows))
        self.row_offset = start
        self.vectors = tensors["vectors"].to(search_device(self.ctx))

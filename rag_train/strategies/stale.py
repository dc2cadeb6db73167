"""Stale buffer (seed 000's baseline): top-k of <f(x), B> over the buffer embedded at step 0, never
refreshed, while the encoders still train. The base of the strategies that search that buffer."""

from __future__ import annotations

import numpy as np
import torch

from rag_train.buffer.search import build_faiss_index
from rag_train.buffer.store import Buffer
from rag_train.strategies.base import IndexedConfig, IndexedStrategy, StrategyContext, read_rows, register


def search_device(ctx: StrategyContext) -> torch.device:
    wanted = ctx.buffer_cfg.device
    if wanted == "auto":
        return ctx.accelerator.device
    return torch.device(wanted)


@register
class Stale(IndexedStrategy):
    name = "stale"
    needs_buffer = True
    searches = frozenset({"full", "rerank"})  # the buffer never changes: a FAISS index over it stays valid

    def __init__(self, cfg: IndexedConfig, ctx: StrategyContext):
        super().__init__(cfg, ctx)
        if ctx.buffer_dir is None:
            raise ValueError(f"strategy {cfg.name!r} needs a stale buffer (buffer.path or a built run buffer)")
        self.buffer = Buffer.open(ctx.buffer_dir)
        self.build_index()

    def build_index(self) -> None:
        """This process's rows of the stale buffer: fp32 in memory on CPU, the buffer dtype on an accelerator,
        or — for buffer.search=rerank, meant for buffers that do not fit device memory — left memory-mapped
        behind a FAISS candidate index built once here (memory-mapped only when the process's rows lie in one
        shard file: rows spanning several are copied into host memory once, by `Buffer.shard`)."""
        start, end = self.local_range(self.buffer.rows)
        self.row_offset = start
        if self.ctx.buffer_cfg.search == "rerank":
            self.vectors = self.buffer.shard(start, end)
            self.faiss_index = build_faiss_index(self.vectors, self.ctx.buffer_cfg.faiss_index,
                                                 self.ctx.buffer_cfg.chunk_rows)
            return
        device = search_device(self.ctx)
        rows = self.buffer.tensor(start, end)
        self.vectors = rows.to(device, torch.float32 if device.type == "cpu" else rows.dtype)

    def reembed(self) -> None:
        """Exhaustive refresh: this process's rows of the buffer re-embedded with the current passage encoder (the
        cost is split across processes); every row counts in `embedded`."""
        start, end = self.row_offset, self.row_offset + len(self.vectors)
        fresh = self.embed(np.arange(start, end))
        self.vectors = fresh.to(self.vectors.device, self.vectors.dtype)
        self.embedded += self.buffer.rows

    def stale_vectors(self, rows: torch.Tensor) -> torch.Tensor:
        """B[rows] for arbitrary global rows, fp32 (read from the memmapped buffer, not the local shard)."""
        return read_rows(self.buffer, rows)

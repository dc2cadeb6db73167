"""Stochastic negative mining: search a uniform sample of M targets, re-sampled and re-embedded every R steps.
The first sample takes its vectors from the stale buffer (embedded at step 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rag_train.config import check_positive
from rag_train.strategies.base import IndexedConfig, register
from rag_train.strategies.stale import Stale, search_device


@dataclass
class SNMConfig(IndexedConfig):
    refresh_every: int = 500  # re-sample and re-embed every R steps
    snm_targets: int = 1_000_000  # size M of the re-sampled, re-embedded subset (at most the corpus)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("strategy", "refresh_every", self.refresh_every)
        check_positive("strategy", "snm_targets", self.snm_targets)


@register
class SNM(Stale):
    name = "snm"
    config = SNMConfig
    searches = frozenset({"full"})  # re-sampled, re-embedded vectors: no index over the stale buffer

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

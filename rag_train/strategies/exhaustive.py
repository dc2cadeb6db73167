"""Exhaustive refresh: the stale buffer re-embedded whole with the current passage encoder every R steps.
Each process re-embeds its own rows, so the cost is split across processes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rag_train.config import check_positive
from rag_train.strategies.base import IndexedConfig, register
from rag_train.strategies.stale import Stale


@dataclass
class ExhaustiveConfig(IndexedConfig):
    refresh_every: int = 500  # re-embed every R steps

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("strategy", "refresh_every", self.refresh_every)


@register
class Exhaustive(Stale):
    name = "exhaustive"
    config = ExhaustiveConfig
    searches = frozenset({"full"})  # refreshed vectors: an index over the stale buffer would go out of date

    def after_step(self, step: int) -> None:
        super().after_step(step)
        if step % self.cfg.refresh_every == 0:
            self.reembed()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(super().state_tensors(), vectors=self.vectors)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.vectors = tensors["vectors"].to(self.vectors.device, self.vectors.dtype)

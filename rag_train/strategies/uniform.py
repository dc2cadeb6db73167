"""Uniformly random passages: Algorithm 1, top_k uniform targets per question (plus the uniform negatives);
Algorithm 2, k random passages per question."""

from __future__ import annotations

import torch

from rag_train.strategies.base import Strategy, register


@register
class Uniform(Strategy):
    name = "uniform"

    def retrieve_global(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        batch = queries.shape[0] * self.ctx.accelerator.num_processes
        return self.uniform_rows(batch * k).reshape(batch, k)

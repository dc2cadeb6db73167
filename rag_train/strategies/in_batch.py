"""In-batch negatives (Algorithm 1): no index. The shared subset is every positive of the global batch, plus
`strategy.uniform_negatives` uniform passages per question (Algorithm 1's uniform targets; 0 = in-batch only)."""

from __future__ import annotations

import torch

from rag_train.strategies.base import Strategy, register


@register
class InBatch(Strategy):
    name = "in_batch"
    algorithms = frozenset({1})  # proposes no per-question passages for a reader

    def retrieve_global(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        """No index: no proposals beyond the batch's positives and the uniform targets."""
        batch = queries.shape[0] * self.ctx.accelerator.num_processes
        return torch.zeros(batch, 0, dtype=torch.long)

"""Corrector networks (seed 000): search <f(x), h(B[y])> over the never-refreshed stale buffer, and train h
on the same passages so that the corrected scores match the fresh ones."""

from __future__ import annotations

from typing import Optional

import torch

from rag_train.config import StrategyConfig
from rag_train.losses import corrector_ce, corrector_mse, retrieval_scores
from rag_train.models.corrector import Corrector
from rag_train.strategies.base import StrategyContext
from rag_train.strategies.buffered import Stale, search_device


class CorrectorStrategy(Stale):
    """Stale buffer + corrector h. Search uses h (no gradient); the corrector loss — CE(P~ || P~_h) or MSE —
    sees only detached encoder outputs, so it updates h alone, and the task loss never reaches h."""

    def __init__(self, cfg: StrategyConfig, ctx: StrategyContext):
        self.search_mode = ctx.buffer_cfg.search if ctx.buffer_cfg.search != "exact" else "corrector_full"
        super().__init__(cfg, ctx)
        self.corrector = Corrector(self.buffer.dim, cfg.corrector.hidden).to(search_device(ctx))

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"corrector": self.corrector}

    def param_groups(self) -> list[dict]:
        # "auxiliary": optimizer_step leaves it out of the clipping norm and drops its update when the corrector diverges
        return [{"params": list(self.corrector.parameters()), "lr": self.cfg.corrector.lr, "weight_decay": 0.0,
                 "auxiliary": True}]

    def search_depth(self, k: int) -> int:
        return max(k, self.cfg.corrector.candidates)

    def auxiliary_loss(
        self, queries: torch.Tensor, rows: torch.Tensor, fresh_vectors: torch.Tensor, fresh_scores: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Runs inside the recipe's training forward (the corrector is a part of its prepared module)."""
        device = fresh_scores.device
        dtype = next(self.corrector.parameters()).dtype  # the engine's (bf16 under DeepSpeed bf16), else fp32
        corrected = self.corrector(self.stale_vectors(rows).to(device, dtype))
        weight = self.cfg.corrector.weight
        if self.cfg.corrector.loss == "mse":
            return weight * corrector_mse(fresh_vectors, corrected)
        corrected_scores = retrieval_scores(queries, corrected)  # [B, S] shared subset or [B, k] per question
        return weight * corrector_ce(fresh_scores, corrected_scores, self.ctx.temperature)

"""Corrector networks (seed 000): search <f(x), h(B[y])> over the never-refreshed stale buffer, and train h
on the same passages so that the corrected scores match the fresh ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from rag_train.config import check_choice, check_positive
from rag_train.losses import corrector_ce, corrector_mse, retrieval_scores
from rag_train.models.corrector import Corrector
from rag_train.strategies.base import IndexedConfig, StrategyContext, register
from rag_train.strategies.stale import Stale, search_device


@dataclass
class CorrectorConfig:
    """h(b) = b + W2 relu(W1 b + c1) + c2, W2 = 0 at init (seed 000). Keys `strategy.corrector.<key>`."""

    hidden: int = 8192
    loss: str = "ce"  # ce (Eq. 6, preferred) | mse (Eq. 5)
    weight: float = 10.0
    lr: float = 1e-4
    # Algorithm 2: h trains on the top-`candidates` of its own ranking (fresh g(y) for them, no gradient); the
    # reader and perplexity distillation still read the top strategy.top_k. 0 = top_k (the paper, k = 32). A
    # small k shows h too little of the ranking to learn which passages the moving retriever now ranks high.
    candidates: int = 0
    # divergence guard: a step whose (weighted) corrector loss is above this skips the corrector's update and
    # keeps the encoder's (0 = off; a non-finite corrector loss or gradient always skips it). See
    # train.step.optimizer_step; train.max_bad_steps such steps in a row stop the run.
    max_loss: float = 0.0
    # the first layer reads the stale vectors standardized by the buffer's own per-dimension mean and sd (computed
    # once at start: the buffer never changes); the same function class, but hidden units that respond to how
    # passages differ, not to the direction an anisotropic language-model buffer shares (docs/toy_world.md)
    standardize: bool = False

    def __post_init__(self) -> None:
        check_positive("strategy.corrector", "hidden", self.hidden)
        check_choice("strategy.corrector", "loss", self.loss, ("ce", "mse"))
        check_positive("strategy.corrector", "weight", self.weight, allow_zero=True)
        check_positive("strategy.corrector", "lr", self.lr)
        check_positive("strategy.corrector", "max_loss", self.max_loss, allow_zero=True)
        check_positive("strategy.corrector", "candidates", self.candidates, allow_zero=True)


@dataclass
class CorrectorStrategyConfig(IndexedConfig):
    corrector: CorrectorConfig = field(default_factory=CorrectorConfig)


@register
class CorrectorStrategy(Stale):
    """Stale buffer + corrector h. Search uses h (no gradient); the corrector loss — CE(P~ || P~_h) or MSE —
    sees only detached encoder outputs, so it updates h alone, and the task loss never reaches h."""

    name = "corrector"
    config = CorrectorStrategyConfig

    def __init__(self, cfg: CorrectorStrategyConfig, ctx: StrategyContext):
        super().__init__(cfg, ctx)
        self.corrector = Corrector(self.buffer.dim, cfg.corrector.hidden, cfg.corrector.standardize).to(search_device(ctx))
        if cfg.corrector.standardize:
            self.corrector.set_input_statistics(*self.buffer.moments())
        # times each corpus row was in the corrector's training subset, saturating at 255 (one byte a row): which
        # rows h has seen, for scripts/diagnose_retriever.py (checkpointed with the strategy's state)
        self.seen = torch.zeros(len(ctx.corpus), dtype=torch.uint8)
        self.tracked: dict[str, torch.Tensor] = {}  # the last step's `tracking_values`

    @property
    def auxiliary_max_loss(self) -> float:
        return self.cfg.corrector.max_loss

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"corrector": self.corrector}

    def param_groups(self) -> list[dict]:
        # "auxiliary": optimizer_step leaves it out of the clipping norm and drops its update when the corrector diverges
        return [{"params": list(self.corrector.parameters()), "lr": self.cfg.corrector.lr, "weight_decay": 0.0,
                 "auxiliary": True}]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(super().state_tensors(), seen=self.seen)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.seen = tensors["seen"]

    def count_seen(self, rows: torch.Tensor) -> None:
        unique = rows.reshape(-1).unique().cpu()
        self.seen[unique] = (self.seen[unique].int() + 1).clamp_(max=255).to(torch.uint8)

    def search_depth(self, k: int) -> int:
        return max(k, self.cfg.corrector.candidates)

    def auxiliary_loss(
        self, queries: torch.Tensor, rows: torch.Tensor, fresh_vectors: torch.Tensor, fresh_scores: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Runs inside the recipe's training forward (the corrector is a part of its prepared module)."""
        self.count_seen(rows)
        device = fresh_scores.device
        dtype = next(self.corrector.parameters()).dtype  # the engine's (bf16 under DeepSpeed bf16), else fp32
        stale = self.stale_vectors(rows).to(device, dtype)
        corrected = self.corrector(stale)
        corrected_scores = retrieval_scores(queries, corrected)  # [B, S] shared subset or [B, k] per question
        self.tracked = tracking_values(stale, corrected.detach(), fresh_vectors, corrected_scores.detach(), fresh_scores)
        weight = self.cfg.corrector.weight
        if self.cfg.corrector.loss == "mse":
            return weight * corrector_mse(fresh_vectors, corrected)
        return weight * corrector_ce(fresh_scores, corrected_scores, self.ctx.temperature)

    def logged_values(self) -> dict[str, float]:
        return {key: value.item() for key, value in self.tracked.items()}


TRACKED_TOP = 4  # the subset ranking's head compared by `tracking_values`


@torch.no_grad()
def tracking_values(stale: torch.Tensor, corrected: torch.Tensor, fresh: torch.Tensor, corrected_scores: torch.Tensor,
                    fresh_scores: torch.Tensor) -> dict[str, torch.Tensor]:
    """How closely h follows g on the subset it trains on this step (tensors: no device sync until logged):
    mean cosine of B[y] and of h(B[y]) with the fresh g(y), and the overlap of each question's top-4 of the subset
    under <f(x), h(B[y])> with its top-4 under <f(x), g(y)> (scripts/diagnose_retriever.py measures the whole
    corpus after training)."""
    def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean()

    k = min(TRACKED_TOP, fresh_scores.shape[-1])
    top_fresh = fresh_scores.topk(k, dim=-1).indices
    top_corrected = corrected_scores.topk(k, dim=-1).indices
    overlap = (top_fresh.unsqueeze(-1) == top_corrected.unsqueeze(-2)).any(dim=-1).float().mean()
    return {"corrector/cos_stale": cosine(stale, fresh), "corrector/cos_corrected": cosine(corrected, fresh),
            "corrector/subset_overlap@4": overlap}

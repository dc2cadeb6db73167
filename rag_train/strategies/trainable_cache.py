"""Trainable cache (dback: Tan et al., AAAI 2026, "gradient optimization of the target embeddings"), the nearest
published rival to the corrector: the stale buffer's rows are kept as trainable vectors and moved by the gradient
of the loss, never re-encoded. It answers "why a learned corrector and not just a gradient on the cache".

Algorithm 1: negatives are the top-k of <f(x), C> over the cache C (the buffer at step 0, fp32), so retrieval
goes through the rows as updated so far. The encoders train on the usual shared subset S with fresh vectors.
The cache's own loss is the same truncated softmax over S with the cached rows in place of the fresh vectors,
L_C = CE(softmax(<f(x), C_y> / tau) over S, positive), queries detached; after the optimizer step every row of S
(the retrieved negatives, the uniform ones and the positives: the rows the step touched) takes one plain SGD step,
C_y <- C_y - `row_lr` * dL_C / dC_y. Rows outside S do not move. With several micro-batches L_C is their mean; with
several processes, the mean over processes (each holds a shard of C and updates its own rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rag_train.config import check_positive
from rag_train.losses import truncated_softmax_ce
from rag_train.strategies.base import IndexedConfig, StrategyContext, Subset, register
from rag_train.strategies.stale import Stale, search_device


@dataclass
class TrainableCacheConfig(IndexedConfig):
    row_lr: float = 1.0e-2  # SGD learning rate of the cached rows (their own; the encoders keep train.lr)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("strategy", "row_lr", self.row_lr)


@register
class TrainableCache(Stale):
    name = "trainable_cache"
    config = TrainableCacheConfig
    algorithms = frozenset({1})  # its loss needs each question's positive in the subset
    searches = frozenset({"full"})  # the rows move: no FAISS index over them stays valid

    def __init__(self, cfg: TrainableCacheConfig, ctx: StrategyContext):
        super().__init__(cfg, ctx)
        self.proposed: list[Subset] = []  # this step's subsets (auxiliary_loss finds its own by its rows)
        self.touched: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (queries, rows, positive_index)
        self.updated_rows = 0  # row updates over the run (a row counts once per step that moved it)
        self.last = {"trainable_cache/loss": 0.0, "trainable_cache/rows": 0.0}

    def build_index(self) -> None:
        """This process's rows of the buffer as fp32 on the search device: the cache every update moves."""
        start, end = self.local_range(self.buffer.rows)
        self.row_offset = start
        self.vectors = self.buffer.tensor(start, end).to(search_device(self.ctx), torch.float32)

    def subset(self, queries: torch.Tensor, positive_rows: torch.Tensor) -> Subset:
        subset = super().subset(queries, positive_rows)
        self.proposed.append(subset)
        return subset

    def auxiliary_loss(
        self, queries: torch.Tensor, rows: torch.Tensor, fresh_vectors: torch.Tensor, fresh_scores: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Records the step's (queries, subset) for the update in `after_step`; no loss for the optimizer."""
        subset = next(s for s in self.proposed if s.rows is rows)
        self.touched.append((queries.detach(), rows.cpu(), subset.positive_index.cpu()))
        return None

    def cached(self, rows: torch.Tensor) -> torch.Tensor:
        """C[rows] for sorted global rows, on every process: each fills the rows of its shard, summed over processes."""
        local = rows.to(self.vectors.device) - self.row_offset
        mine = (local >= 0) & (local < len(self.vectors))
        out = torch.zeros(len(rows), self.vectors.shape[1], device=self.vectors.device)
        out[mine] = self.vectors[local[mine]]
        acc = self.ctx.accelerator
        return acc.reduce(out.to(acc.device), "sum").to(out.device) if acc.num_processes > 1 else out

    def after_step(self, step: int) -> None:
        """One SGD step on the rows the step touched, by the gradient of L_C at the cache as the step saw it."""
        super().after_step(step)
        touched, self.touched, self.proposed = self.touched, [], []
        if not touched:
            return
        rows = torch.unique(torch.cat([r for _, r, _ in touched]))
        leaf = self.cached(rows).requires_grad_()
        with torch.enable_grad():
            loss = sum(truncated_softmax_ce(queries.to(leaf) @ leaf[torch.searchsorted(rows, sub)].T,
                                            positive.to(leaf.device), self.ctx.temperature)
                       for queries, sub, positive in touched) / len(touched)
            (grad,) = torch.autograd.grad(loss, leaf)
        loss = loss.detach()
        acc = self.ctx.accelerator
        if acc.num_processes > 1:  # each process's loss is the mean over its questions: the global one is their mean
            grad = acc.reduce(grad.to(acc.device), "mean").to(leaf.device)
            loss = acc.reduce(loss.to(acc.device), "mean")
        local = rows.to(self.vectors.device) - self.row_offset
        mine = (local >= 0) & (local < len(self.vectors))
        self.vectors[local[mine]] -= self.cfg.row_lr * grad[mine]
        self.updated_rows += len(rows)
        self.last = {"trainable_cache/loss": float(loss), "trainable_cache/rows": float(len(rows))}

    def logged_values(self) -> dict[str, float]:
        """The cache's loss L_C and the rows it moved, at the last step."""
        return dict(self.last)

    def summary(self) -> dict:
        return {"device_memory_pct": 100.0, "updated_rows": self.updated_rows}  # the whole buffer, fp32

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(super().state_tensors(), vectors=self.vectors, updated_rows=torch.tensor([self.updated_rows]))

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.vectors = tensors["vectors"].to(search_device(self.ctx), torch.float32)
        self.updated_rows = int(tensors["updated_rows"][0])

"""Streaming negative cache (seed 004, Algorithm 2), for supervised retrieval (Algorithm 1 of seed 000).

The cache is a multiset of `cache_size` passages drawn uniformly with replacement, with vectors from the
encoder at insertion time (no gradient). For each question, one negative J is drawn by Gumbel-max from the
cache scores (all copies of the question's positive removed), with the 1/alpha correction
(alpha = cache_size / corpus size) added to every cached score. Only the positive and J are re-encoded with
gradient. The loss is the surrogate (1 - p_y)(s_J - s_y) whose gradient is unbiased for the full softmax CE;
the cache CE is logged separately. After each step the `cache_refresh` oldest entries are replaced by new
uniform passages encoded with the updated encoder (each entry lives cache_size / cache_refresh steps).

J is drawn independently per question; the cache is replicated on every process, and J is drawn for the
global batch with a generator shared by all processes, so 1 and N processes draw the same J.

Algorithm 1 only: it replaces the shared subset and the task loss, and proposes no passages for a reader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rag_train.buffer.store import Buffer
from rag_train.config import check_positive
from rag_train.losses import cache_ce, cache_positive_probability, cache_surrogate, sample_cache_negative
from rag_train.strategies.base import (
    BaseStrategyConfig,
    Strategy,
    StrategyContext,
    Subset,
    gather_queries,
    read_rows,
    register,
)


@dataclass
class NegativeCacheConfig(BaseStrategyConfig):
    cache_size: int = 65536  # streaming cache size (alpha * m), at most the corpus
    cache_refresh: int = 256  # entries evicted / inserted per step

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("strategy", "cache_size", self.cache_size)
        check_positive("strategy", "cache_refresh", self.cache_refresh)

    def corpus_limits(self) -> list[tuple[str, int]]:
        return [*super().corpus_limits(), ("strategy.cache_size", self.cache_size)]


@dataclass
class CacheSubset(Subset):
    negative_index: torch.Tensor  # [B_local] index of each question's sampled negative J in `rows`
    cache_scores: torch.Tensor  # [B_local, cache] stale scores <f(x), E_j>
    cache_is_positive: torch.Tensor  # [B_local, cache] copies of the question's positive (removed)


@register
class NegativeCache(Strategy):
    name = "negative_cache"
    config = NegativeCacheConfig
    algorithms = frozenset({1})
    needs_buffer = True  # the first cache vectors come from the buffer (the initial encoder), not re-embedded

    def __init__(self, cfg: NegativeCacheConfig, ctx: StrategyContext):
        super().__init__(cfg, ctx)
        total = len(ctx.corpus)
        self.alpha = cfg.cache_size / total
        self.cache_rows = torch.randint(total, (cfg.cache_size,), generator=self.generator)
        self.oldest = 0  # FIFO pointer: the next `cache_refresh` entries from here are the oldest
        buffer = Buffer.open(ctx.buffer_dir)
        self.cache_vectors = read_rows(buffer, self.cache_rows).to(ctx.accelerator.device)

    def subset(self, queries: torch.Tensor, positive_rows: torch.Tensor) -> CacheSubset:
        acc = self.ctx.accelerator
        all_queries = gather_queries(queries, acc).float()
        positives = (acc.gather(positive_rows.contiguous()) if acc.num_processes > 1 else positive_rows).cpu()
        scores = (all_queries @ self.cache_vectors.t()).cpu()  # [B_global, cache]
        is_positive = self.cache_rows.unsqueeze(0) == positives.unsqueeze(1)
        sampled = sample_cache_negative(scores, is_positive, self.ctx.temperature, self.generator)
        negatives = self.cache_rows[sampled]
        rows = torch.unique(torch.cat([positives, negatives]))
        per_rank = len(positives) // acc.num_processes
        mine = slice(acc.process_index * per_rank, (acc.process_index + 1) * per_rank)
        return CacheSubset(
            rows=rows,
            positive_index=torch.searchsorted(rows, positives[mine]),
            negative_index=torch.searchsorted(rows, negatives[mine]),
            cache_scores=scores[mine],
            cache_is_positive=is_positive[mine],
        )

    def task_loss(self, scores: torch.Tensor, subset: CacheSubset) -> tuple[torch.Tensor, dict[str, float]]:
        device = scores.device
        batch = torch.arange(scores.shape[0], device=device)
        positive = scores[batch, subset.positive_index.to(device)]
        negative = scores[batch, subset.negative_index.to(device)]
        stale, is_positive = subset.cache_scores.to(device), subset.cache_is_positive.to(device)
        temperature = self.ctx.temperature
        p_y = cache_positive_probability(positive, stale, is_positive, self.alpha, temperature)
        surrogate = cache_surrogate(positive, negative, p_y, temperature)
        logged = cache_ce(positive.detach(), stale, is_positive, self.alpha, temperature)
        return surrogate, {"cache_ce": logged.item()}

    def after_step(self, step: int) -> None:
        super().after_step(step)
        count = min(self.cfg.cache_refresh, self.cfg.cache_size)
        slots = (self.oldest + torch.arange(count)) % self.cfg.cache_size
        new_rows = torch.randint(len(self.ctx.corpus), (count,), generator=self.generator)
        self.cache_rows[slots] = new_rows
        self.cache_vectors[slots.to(self.cache_vectors.device)] = self.embed_everywhere(new_rows)
        self.oldest = int((self.oldest + count) % self.cfg.cache_size)
        self.embedded += count

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(super().state_tensors(), cache_rows=self.cache_rows, cache_vectors=self.cache_vectors,
                    oldest=torch.tensor([self.oldest]))

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.cache_rows = tensors["cache_rows"]
        self.cache_vectors = tensors["cache_vectors"].to(self.ctx.accelerator.device)
        self.oldest = int(tensors["oldest"][0])

"""Dynnibal (seed 001, Monath et al., AISTATS 2023) as the negative-mining strategy of Algorithm 1.

Targets live in host memory as d'-dimensional Nyström representations (rag_train.buffer.nystrom) of the stale
buffer, indexed by a forest of SG trees (rag_train.buffer.sg_tree). For each question of the global batch:
FindClustering around its query (the frontier of the forest, at most `max_clusters` clusters), the cluster proposal
Q(y|x), `mh_chains` independent Metropolis-Hastings chains of `mh_steps` steps each (the sampler the paper runs);
the `top_k` best-scoring distinct final states other than the question's positive are its negatives ("keep the
top-scoring targets across chains"). The subset is the usual shared union (positives, i.e. in-batch negatives,
+ `uniform_negatives` uniform targets per question + the sampled negatives), and the loss the truncated softmax
over it with fresh vectors (the paper's L = -beta s_pos + log Z^ with shared negatives, no importance correction).

Every `refresh_every` steps (w), Nyström re-encoding (Alg. 5): the fixed landmarks and `nystrom_samples` random
targets are re-encoded with the current encoder (counted in `embedded`), a ridge regression from their cached
representations to the new vectors is applied to every cached target, and each tree is maintained (Alg. 3: the
subtrees whose covering or sibling separation fails on the moved points are rebuilt, re-attached in place).

Every process holds the same cache and forest and draws from the shared generator, so every process proposes the
same subset (N processes = 1 process). metrics.json's `strategy_summary` holds the device memory it would need
(landmarks, regression data and weights at full dimension, as % of the full buffer), the host cache, the forest and
the re-encoding counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rag_train.buffer import nystrom
from rag_train.buffer.sg_tree import SGTree, build_forest, find_clustering, metropolis_hastings
from rag_train.buffer.store import Buffer
from rag_train.config import ConfigError, check_positive
from rag_train.strategies.base import (BaseStrategyConfig, Strategy, StrategyContext, Subset, gather_queries, read_rows,
                                       register)


@dataclass
class DynnibalConfig(BaseStrategyConfig):
    refresh_every: int = 500  # w: Nyström re-encoding and tree maintenance every w steps
    landmarks: int = 128  # d': fixed landmark targets (the low dimension), at most the corpus
    nystrom_samples: int = 8192  # s': targets re-encoded every w steps to fit the regression, at most the corpus
    nystrom_ridge: float = 1.0e-3  # ridge of the regression, relative to the mean eigenvalue of T^T T
    trees: int = 100  # SG trees in the forest (each over a random part of the targets)
    tree_base: float = 1.05  # base b of the SG trees (levels are powers of b)
    tree_children: int = 16  # farthest-first centres per node at least (more while covering needs them)
    tree_leaf: int = 8  # a node of at most this many targets is one leaf cluster
    max_clusters: int = 100  # FindClustering's frontier cap (over the whole forest)
    deepest_level: int = -14  # m: FindClustering expands no node at level <= m
    mh_chains: int = 32  # independent Metropolis-Hastings chains per question
    mh_steps: int = 2  # steps per chain

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("refresh_every", "landmarks", "nystrom_samples", "trees", "tree_children", "tree_leaf",
                    "max_clusters", "mh_chains"):
            check_positive("strategy", key, getattr(self, key))
        check_positive("strategy", "nystrom_ridge", self.nystrom_ridge, allow_zero=True)
        check_positive("strategy", "mh_steps", self.mh_steps, allow_zero=True)
        if not self.tree_base > 1:
            raise ConfigError(f"strategy.tree_base={self.tree_base!r} must be > 1")

    def corpus_limits(self) -> list[tuple[str, int]]:
        return [*super().corpus_limits(), ("strategy.landmarks", self.landmarks),
                ("strategy.nystrom_samples", self.nystrom_samples), ("strategy.trees", self.trees)]


@register
class Dynnibal(Strategy):
    name = "dynnibal"
    config = DynnibalConfig
    algorithms = frozenset({1})  # samples negatives for a softmax; proposes no top-k passages for a reader
    needs_buffer = True  # the first representations come from the buffer (the initial encoder)

    def __init__(self, cfg: DynnibalConfig, ctx: StrategyContext):
        super().__init__(cfg, ctx)
        if ctx.buffer_dir is None:
            raise ValueError("strategy 'dynnibal' needs a stale buffer (buffer.path or a built run buffer)")
        buffer = Buffer.open(ctx.buffer_dir)
        self.total, self.dim = buffer.rows, buffer.dim
        self.landmark_rows = torch.randperm(self.total, generator=self.generator)[: cfg.landmarks].sort().values
        self.projection = nystrom.whitening(read_rows(buffer, self.landmark_rows).numpy())
        self.low = nystrom.represent(buffer.array(), self.projection)
        self.forest = build_forest(self.low, cfg.trees, self.numpy_rng(), cfg.tree_base, cfg.tree_children,
                                   cfg.tree_leaf)
        self.refreshes, self.rebuilt_points = 0, 0
        self.positives: torch.Tensor | None = None

    def numpy_rng(self) -> np.random.Generator:
        """A numpy generator seeded from the shared torch generator (the same on every process, checkpointed)."""
        return np.random.default_rng(int(torch.randint(2**62, (1,), generator=self.generator)))

    # -- Algorithm 1 --------------------------------------------------------------------------------------------

    def subset(self, queries: torch.Tensor, positive_rows: torch.Tensor) -> Subset:
        acc = self.ctx.accelerator
        self.positives = (acc.gather(positive_rows.contiguous()) if acc.num_processes > 1 else positive_rows).cpu()
        return super().subset(queries, positive_rows)

    def retrieve_global(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        """[B_global, k]: per question, the k best-scoring distinct MH samples that are not its positive (padded
        with the positive, which the shared subset holds anyway, when the chains found fewer)."""
        cfg = self.cfg
        low_queries = gather_queries(queries, self.ctx.accelerator).double().cpu().numpy() @ self.projection
        positives = self.positives if self.positives is not None else torch.full((len(low_queries),), -1)
        beta = 1.0 / self.ctx.temperature
        rng = self.numpy_rng()
        out = np.empty((len(low_queries), k), dtype=np.int64)
        for i, query in enumerate(low_queries):
            clustering = find_clustering(self.forest, self.low, query, cfg.deepest_level, cfg.max_clusters)
            states = metropolis_hastings(clustering, self.low, query, beta, cfg.mh_chains, cfg.mh_steps, rng)
            found = np.unique(states)
            found = found[found != int(positives[i])]
            best = found[np.argsort(-(self.low[found] @ query), kind="stable")][:k]
            out[i] = np.concatenate([best, np.full(k - len(best), int(positives[i]))])
        self.positives = None
        return torch.from_numpy(out)

    # -- re-encoding and tree maintenance -----------------------------------------------------------------------

    def after_step(self, step: int) -> None:
        super().after_step(step)
        if step % self.cfg.refresh_every == 0:
            self.refresh()

    def refresh(self) -> None:
        """Alg. 5: re-encode the landmarks and s' random targets, fit the regression, move every cached target
        through it, maintain the trees (Alg. 3)."""
        cfg = self.cfg
        sample = torch.randperm(self.total, generator=self.generator)[: cfg.nystrom_samples]
        fresh = self.embed_everywhere(torch.cat([self.landmark_rows, sample])).double().cpu().numpy()
        self.embedded += len(self.landmark_rows) + len(sample)
        landmarks, targets = fresh[: len(self.landmark_rows)], fresh[len(self.landmark_rows):]
        regression = nystrom.fit_regression(self.low[sample.numpy()], targets, cfg.nystrom_ridge)
        self.projection = nystrom.whitening(landmarks)
        self.low = nystrom.reencode(self.low, regression, self.projection)
        self.forest = [tree.update(self.low, None, cfg.tree_children, cfg.tree_leaf) for tree in self.forest]
        self.rebuilt_points += sum(tree.rebuilt_points for tree in self.forest)
        self.refreshes += 1

    # -- reporting and state ------------------------------------------------------------------------------------

    def summary(self) -> dict:
        d_low, cfg = self.low.shape[1], self.cfg
        full = self.total * self.dim
        device = (2 * len(self.landmark_rows) + min(cfg.nystrom_samples, self.total)) * self.dim + d_low * self.dim
        return {
            "device_memory_pct": 100.0 * device / full,  # landmarks, regression data and weights, projection
            "host_memory_pct": 100.0 * self.low.size / full,  # the low-dimensional cache (CPU memory)
            "low_dim": d_low,
            "trees": len(self.forest),
            "tree_nodes": int(sum(len(tree.centre) for tree in self.forest)),
            "refreshes": self.refreshes,
            "reencoded_per_refresh": len(self.landmark_rows) + min(cfg.nystrom_samples, self.total),
            "reencoded": self.embedded,
            "tree_rebuilt_points": self.rebuilt_points,
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = dict(super().state_tensors(), landmark_rows=self.landmark_rows,
                   projection=torch.from_numpy(self.projection), low=torch.from_numpy(self.low),
                   counters=torch.tensor([self.refreshes, self.rebuilt_points, len(self.forest)]))
        for t, tree in enumerate(self.forest):
            out.update({f"tree{t}.{key}": torch.from_numpy(np.ascontiguousarray(value))
                        for key, value in tree.arrays().items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.landmark_rows = tensors["landmark_rows"]
        self.projection = tensors["projection"].numpy()
        self.low = tensors["low"].numpy()
        self.refreshes, self.rebuilt_points, trees = (int(v) for v in tensors["counters"])
        self.forest = [SGTree.from_arrays({key.split(".", 1)[1]: value.numpy() for key, value in tensors.items()
                                           if key.startswith(f"tree{t}.")}) for t in range(trees)]

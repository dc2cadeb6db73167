"""Dynnibal (seed 001, Monath et al., AISTATS 2023) as the negative-mining strategy of Algorithm 1, with the
schedule of the paper's runs (Appendix C).

Warm start: for the first `warm_start_steps` steps the strategy is the uniform strategy (the same draws from the
same generator); then Dynnibal starts from the encoder as it is (Alg. 6): every target is encoded, the Nyström map
fitted on the `landmarks`, a forest of SG trees built. With no warm start the stale buffer (the initial encoder)
takes the place of that first encoding. Targets live in host memory as d'-dimensional Nyström representations
(rag_train.buffer.nystrom), indexed by a forest of `trees` SG trees (rag_train.buffer.sg_tree).

For each question of the global batch: FindClustering around its query on every tree (Alg. 2: the frontier
initialised at the level l that the allowed error `allowed_error` gives, each tree's frontier at most
`max_clusters` clusters), the `top_clusters` clusters closest to the query, the cluster proposal Q(y|x) at the
sampling temperature, `mh_chains` independent Metropolis-Hastings chains of `mh_steps` steps each; the `top_k`
best-scoring distinct final states other than the question's positive are its negatives ("keep the top-scoring
targets across chains"). The subset is the usual shared union (positives, i.e. in-batch negatives,
+ `uniform_negatives` uniform targets per question + the sampled negatives), and the loss the truncated softmax
over it with fresh vectors (the paper's L = -beta s_pos + log Z^ with shared negatives, no importance correction).

Every `refresh_every` steps (w), Nyström re-encoding (Alg. 5): the fixed landmarks and `nystrom_samples` random
targets are re-encoded with the current encoder (counted in `embedded`), a ridge regression from their cached
representations to the new vectors is applied to every cached target, and each tree is maintained (Alg. 3: the
subtrees whose covering or sibling separation fails on the moved points are rebuilt, re-attached in place). At
step `full_refresh_step` every target is encoded again instead, the Nyström map re-fitted and the forest rebuilt.
With `refresh_every` 0, no warm start and no full refresh, nothing is ever re-encoded: the trees stay over the stale
buffer (seed 000's "Dynnibal +0").

Every process holds the same cache and forest and draws from the shared generator, so every process proposes the
same subset (N processes = 1 process). metrics.json's `strategy_summary` holds the device memory it would need
(landmarks, regression data and weights at full dimension, as % of the full buffer), the host cache, the forest,
the re-encoding counts and how far FindClustering expanded (clusters per query, mean depth of their nodes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from rag_train.buffer import nystrom
from rag_train.buffer.sg_tree import SGTree, build_forest, find_clustering, metropolis_hastings, start_level
from rag_train.buffer.store import Buffer, decode_rows
from rag_train.config import ConfigError, check_positive
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
class DynnibalConfig(BaseStrategyConfig):
    """Defaults are the paper's NQ run where it gives a value (docs/dynnibal.md lists them)."""

    refresh_every: int = 500  # w: Nyström re-encoding and tree maintenance every w steps (0: never, Dynnibal "+0")
    landmarks: int = 128  # d': fixed landmark targets (the low dimension), at most the corpus
    nystrom_samples: int = 8192  # s': targets re-encoded every w steps to fit the regression, at most the corpus
    nystrom_ridge: float = 1.0e-3  # ridge of the regression, relative to the mean eigenvalue of T^T T
    trees: int = 100  # SG trees in the forest (each over a random part of the targets)
    tree_base: float = 1.05  # base b of the SG trees (levels are powers of b)
    tree_children: int = 16  # farthest-first centres per node at least (more while covering needs them)
    tree_leaf: int = 8  # a node of at most this many targets is one leaf cluster
    max_clusters: int = 100  # FindClustering's frontier cap, per tree (the paper's cap for its single tree)
    deepest_level: int = -14  # m: FindClustering expands no node at level <= m
    allowed_error: float = 0.0  # gamma > 1: frontier starts at l = max{l : b^l <= log(gamma) / (2 beta)}; 0: the roots
    top_clusters: int = 0  # sample from the k clusters of the partition closest to the query (0: all of them)
    sampling_temperature: float = 0.0  # 1 / beta of the proposal and MH target (0: train.temperature, the loss's)
    mh_chains: int = 32  # independent Metropolis-Hastings chains per question
    mh_steps: int = 2  # steps per chain
    warm_start_steps: int = 4000  # steps with uniform negatives before Dynnibal starts (NQ 4000, MS MARCO 8000)
    full_refresh_step: int = 7500  # the step after which every target is re-encoded (NQ 7500; 0: never)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("landmarks", "nystrom_samples", "trees", "tree_children", "tree_leaf", "max_clusters", "mh_chains"):
            check_positive("strategy", key, getattr(self, key))
        for key in ("refresh_every", "nystrom_ridge", "mh_steps", "top_clusters", "sampling_temperature",
                    "warm_start_steps", "full_refresh_step", "allowed_error"):
            check_positive("strategy", key, getattr(self, key), allow_zero=True)
        if not self.tree_base > 1:
            raise ConfigError(f"strategy.tree_base={self.tree_base!r} must be > 1")
        if self.max_clusters < self.tree_children:
            raise ConfigError(f"strategy.max_clusters={self.max_clusters} is below strategy.tree_children="
                              f"{self.tree_children}: a root splits into at least that many clusters, so no tree "
                              "could expand and the sampler would propose from the roots alone (near uniform)")
        if self.allowed_error != 0 and not self.allowed_error > 1:
            raise ConfigError(f"strategy.allowed_error={self.allowed_error!r} must be > 1 (a bound on P / Q), "
                              "or 0 to start the frontier at the roots")
        if self.full_refresh_step and self.full_refresh_step <= self.warm_start_steps:
            raise ConfigError(f"strategy.full_refresh_step={self.full_refresh_step} must come after "
                              f"strategy.warm_start_steps={self.warm_start_steps} (or be 0: no full refresh)")

    def corpus_limits(self) -> list[tuple[str, int]]:
        return [*super().corpus_limits(), ("strategy.landmarks", self.landmarks),
                ("strategy.nystrom_samples", self.nystrom_samples), ("strategy.trees", self.trees)]


@register
class Dynnibal(Strategy):
    name = "dynnibal"
    config = DynnibalConfig
    algorithms = frozenset({1})  # samples negatives for a softmax; proposes no top-k passages for a reader
    needs_buffer = True  # without a warm start, the first representations come from the buffer (the initial encoder)

    def __init__(self, cfg: DynnibalConfig, ctx: StrategyContext):
        super().__init__(cfg, ctx)
        if ctx.buffer_dir is None:
            raise ValueError("strategy 'dynnibal' needs a stale buffer (buffer.path or a built run buffer)")
        buffer = Buffer.open(ctx.buffer_dir)
        self.total, self.dim = buffer.rows, buffer.dim
        self.beta = 1.0 / (cfg.sampling_temperature or ctx.temperature)
        # set when Dynnibal starts (None during the warm start, which draws nothing else from the generator)
        self.landmark_rows: Optional[torch.Tensor] = None
        self.projection: Optional[np.ndarray] = None
        self.low: Optional[np.ndarray] = None
        self.forest: list[SGTree] = []
        self.refreshes, self.full_encodings, self.rebuilt_points = 0, 0, 0
        self.sampled_questions, self.cluster_total, self.depth_total = 0, 0.0, 0.0  # run totals (summary)
        self.last = {"sampled": 0.0, "clusters_per_query": 0.0, "frontier_depth": 0.0}  # the last step's
        self.positives: torch.Tensor | None = None
        if cfg.warm_start_steps == 0:
            self.landmark_rows = self.draw_landmarks()
            projection = nystrom.whitening(read_rows(buffer, self.landmark_rows).numpy())
            decode = functools.partial(decode_rows, dtype=buffer.dtype)  # shard by shard: no copy of the buffer
            self.start(projection, np.concatenate([nystrom.represent(piece, projection, decode=decode)
                                                   for _, piece in buffer.views()]))

    def numpy_rng(self) -> np.random.Generator:
        """A numpy generator seeded from the shared torch generator (the same on every process, checkpointed)."""
        return np.random.default_rng(int(torch.randint(2**62, (1,), generator=self.generator)))

    def draw_landmarks(self) -> torch.Tensor:
        return torch.randperm(self.total, generator=self.generator)[: self.cfg.landmarks].sort().values

    def start(self, projection: np.ndarray, low: np.ndarray) -> None:
        """Take a new Nyström map and cache, and build the forest over it."""
        cfg = self.cfg
        self.projection, self.low = projection, low
        self.forest = build_forest(low, cfg.trees, self.numpy_rng(), cfg.tree_base, cfg.tree_children, cfg.tree_leaf)
        self.check_expands()

    def check_expands(self) -> None:
        """ConfigError when every tree's root has more children than the frontier cap: FindClustering could
        never expand and would propose from the roots alone."""
        splits = [tree.child_hi[0] - tree.child_lo[0] for tree in self.forest]
        if all(n == 0 or n > self.cfg.max_clusters for n in splits) and any(splits):
            raise ConfigError(f"strategy.max_clusters={self.cfg.max_clusters}: every SG tree's root splits into more "
                              f"clusters ({min(n for n in splits if n)} or more), so FindClustering could never "
                              "expand; raise strategy.max_clusters or lower strategy.tree_children")

    # -- Algorithm 1 --------------------------------------------------------------------------------------------

    def subset(self, queries: torch.Tensor, positive_rows: torch.Tensor) -> Subset:
        acc = self.ctx.accelerator
        self.positives = (acc.gather(positive_rows.contiguous()) if acc.num_processes > 1 else positive_rows).cpu()
        return super().subset(queries, positive_rows)

    def retrieve_global(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        """[B_global, k]: per question, the k best-scoring distinct MH samples that are not its positive (padded
        with the positive, which the shared subset holds anyway, when the chains found fewer). During the warm
        start: k uniform targets per question, as the uniform strategy draws them."""
        batch = queries.shape[0] * self.ctx.accelerator.num_processes
        if self.low is None:
            self.positives = None
            self.last = {"sampled": 0.0, "clusters_per_query": 0.0, "frontier_depth": 0.0}
            return self.uniform_rows(batch * k).reshape(batch, k)
        cfg = self.cfg
        low_queries = gather_queries(queries, self.ctx.accelerator).double().cpu().numpy() @ self.projection
        positives = self.positives if self.positives is not None else torch.full((len(low_queries),), -1)
        level = start_level(cfg.allowed_error, self.beta, cfg.tree_base)
        rng = self.numpy_rng()
        out = np.empty((len(low_queries), k), dtype=np.int64)
        clusters, depths = [], []
        for i, query in enumerate(low_queries):
            clustering = find_clustering(self.forest, self.low, query, cfg.deepest_level, cfg.max_clusters, level)
            clusters.append(len(clustering.rep))
            depths.append(float(clustering.depth.mean()))
            used = clustering.closest(cfg.top_clusters, self.low, query)
            states = metropolis_hastings(used, self.low, query, self.beta, cfg.mh_chains, cfg.mh_steps, rng)
            found = np.unique(states)
            found = found[found != int(positives[i])]
            best = found[np.argsort(-(self.low[found] @ query), kind="stable")][:k]
            out[i] = np.concatenate([best, np.full(k - len(best), int(positives[i]))])
        self.positives = None
        self.sampled_questions += len(low_queries)
        self.cluster_total += float(sum(clusters))
        self.depth_total += float(sum(depths))
        self.last = {"sampled": 1.0, "clusters_per_query": float(np.mean(clusters)),
                     "frontier_depth": float(np.mean(depths))}
        return torch.from_numpy(out)

    # -- re-encoding and tree maintenance -----------------------------------------------------------------------

    def after_step(self, step: int) -> None:
        super().after_step(step)
        if step in (self.cfg.warm_start_steps, self.cfg.full_refresh_step):
            self.encode_all()
        elif self.low is not None and self.cfg.refresh_every and step % self.cfg.refresh_every == 0:
            self.refresh()

    def encode_all(self) -> None:
        """Alg. 6 with the current encoder (the end of the warm start, the full refresh): every target encoded
        (counted), the Nyström map fitted on the landmarks' new vectors, the forest rebuilt. The corpus is
        streamed `buffer.chunk_rows` rows at a time: host memory holds the low-dimensional cache and one chunk."""
        if self.landmark_rows is None:
            self.landmark_rows = self.draw_landmarks()
        marks = self.landmark_rows.numpy()
        landmarks = self.embed_everywhere(self.landmark_rows).double().cpu().numpy()
        projection = nystrom.whitening(landmarks)
        low = np.empty((self.total, projection.shape[1]), dtype=np.float32)
        low[marks] = nystrom.represent(landmarks, projection)
        rest = np.setdiff1d(np.arange(self.total), marks)
        chunk = self.ctx.buffer_cfg.chunk_rows
        for begin in range(0, len(rest), chunk):
            rows = rest[begin:begin + chunk]
            low[rows] = nystrom.represent(self.embed_everywhere(torch.from_numpy(rows)).double().cpu().numpy(),
                                          projection)
        self.embedded += self.total
        self.full_encodings += 1
        self.start(projection, low)

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

    def logged_values(self) -> dict[str, float]:
        """Per logged step: whether its negatives were sampled (0: warm start), FindClustering's clusters per
        question and the mean depth of their nodes below the roots, and the targets encoded so far."""
        return {**{f"dynnibal/{key}": value for key, value in self.last.items()},
                "dynnibal/reencoded": float(self.embedded)}

    def summary(self) -> dict:
        cfg = self.cfg
        full = self.total * self.dim
        d_low = cfg.landmarks if self.low is None else self.low.shape[1]
        device = (2 * cfg.landmarks + min(cfg.nystrom_samples, self.total)) * self.dim + d_low * self.dim
        questions = max(self.sampled_questions, 1)
        return {
            "device_memory_pct": 100.0 * device / full,  # landmarks, regression data and weights, projection
            "host_memory_pct": 100.0 * self.total * d_low / full,  # the low-dimensional cache (CPU memory)
            "low_dim": d_low,
            "trees": len(self.forest),
            "tree_nodes": int(sum(len(tree.centre) for tree in self.forest)),
            "refreshes": self.refreshes,
            "full_encodings": self.full_encodings,  # the warm start's end and the full refresh
            "reencoded_per_refresh": cfg.landmarks + min(cfg.nystrom_samples, self.total),
            "reencoded": self.embedded,
            "tree_rebuilt_points": self.rebuilt_points,
            "sampled_questions": self.sampled_questions,
            "clusters_per_query": self.cluster_total / questions,  # FindClustering's partition, mean over questions
            "mean_frontier_depth": self.depth_total / questions,  # depth of its clusters' nodes below their roots
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = dict(super().state_tensors(),
                   counters=torch.tensor([self.refreshes, self.full_encodings, self.rebuilt_points, len(self.forest),
                                          self.sampled_questions]),
                   totals=torch.tensor([self.cluster_total, self.depth_total], dtype=torch.float64))
        if self.landmark_rows is not None:
            out["landmark_rows"] = self.landmark_rows
        if self.low is not None:
            out.update(projection=torch.from_numpy(self.projection), low=torch.from_numpy(self.low))
        for t, tree in enumerate(self.forest):
            out.update({f"tree{t}.{key}": torch.from_numpy(np.ascontiguousarray(value))
                        for key, value in tree.arrays().items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.landmark_rows = tensors.get("landmark_rows")
        self.projection = tensors["projection"].numpy() if "projection" in tensors else None
        self.low = tensors["low"].numpy() if "low" in tensors else None
        self.refreshes, self.full_encodings, self.rebuilt_points, trees, self.sampled_questions = (
            int(v) for v in tensors["counters"])
        self.cluster_total, self.depth_total = (float(v) for v in tensors["totals"])
        self.forest = [SGTree.from_arrays({key.split(".", 1)[1]: value.numpy() for key, value in tensors.items()
                                           if key.startswith(f"tree{t}.")}) for t in range(trees)]

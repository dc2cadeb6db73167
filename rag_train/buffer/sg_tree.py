"""SG trees (seed 001, Monath et al. 2023, §3; Zaheer et al. 2019) over target vectors in host memory (numpy),
the cluster proposal Q(y|x), the exact rejection sampler and the independent Metropolis-Hastings sampler.

Metric: Euclidean distance between the tree's points (for Dynnibal: the Nyström representations, whose
Euclidean distances equal those between the approximate full-dimensional target vectors; on unit vectors
||a - b||^2 = 2 - 2 <a, b>). A score is an inner product <q, y>; by Cauchy-Schwarz a target within distance r of
its cluster's centre scores within ||q|| r of the centre, which is what every bound below uses (the paper's
unit-norm queries make that ||q|| = 1). The paper's exp(-similarity) is not a metric (no triangle inequality),
so the covering bounds would not hold with it.

Invariants of a tree with base b (checked by `check_invariants`):
  * nesting: a node's first child has the node's own centre, and child levels are strictly below the parent's;
  * covering with radii: every point under a node lies within `radius` (maxd, stored) of its centre, and
    radius <= b^level;
  * separation (SG tree: among siblings only): siblings at level l are pairwise at least b^(l-1) apart.

Build (top-down, all nodes of a round at once, vectorised): a node's children are a farthest-first
(Gonzalez) net of its points, started at its own centre, of at least `max_children` centres (fewer only when the
node has fewer distinct points) and continued while some point is farther than b^(level-1) from every centre;
each point goes to its nearest centre. The last centre was chosen at distance delta from all earlier ones,
so siblings are >= delta apart and every point is within delta of its centre: the children take level
min(floor(log_b delta) + 1, level - 1) (levels may skip, as in an explicit cover tree). A node with at most
`leaf_size` points is a leaf whose points form one bucket. Cost: O(rounds * centres * N * d) float operations.

Points of a node are the contiguous range order[start:end]; children of a node are nodes child_lo..child_hi-1,
and their ranges tile their parent's.

Long file: the tree, its two samplers and the invariant checker share the node arrays and the covering bounds
above; apart, each would restate them.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

FIELDS = ("centre", "level", "radius", "start", "end", "child_lo", "child_hi", "parent", "order")


def _floor_log(x: np.ndarray, base: float) -> np.ndarray:
    return np.floor(np.log(np.maximum(x, 1e-30)) / math.log(base)).astype(np.int64)


def _range_positions(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenated positions start .. start + count - 1 of every (start, count) pair."""
    return np.repeat(starts, counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))


def _segment_starts(seg: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.flatnonzero(np.diff(seg)) + 1]) if len(seg) else np.zeros(0, np.int64)


@dataclass
class SGTree:
    """One SG tree over `members` (row ids into `points`), stored as flat node arrays (see the module doc)."""

    base: float
    centre: np.ndarray  # [nodes] point id of the node's centre
    level: np.ndarray  # [nodes]
    radius: np.ndarray  # [nodes] maxd: distance from the centre to its farthest point
    start: np.ndarray  # [nodes] range of the node's points in `order`
    end: np.ndarray
    child_lo: np.ndarray  # [nodes] children are child_lo .. child_hi - 1 (none: a leaf bucket)
    child_hi: np.ndarray
    parent: np.ndarray  # [nodes] -1 for the root
    order: np.ndarray  # [points] point ids, each node's points contiguous
    rebuilt_points: int = field(default=0)  # points under the subtrees rebuilt by the last `update`
    # [nodes] mind as measured after the last build / update (the paper's bound tests start from it); None: never
    mind: Optional[np.ndarray] = field(default=None)

    # -- construction -----------------------------------------------------------------------------------------

    @classmethod
    def build(cls, points: np.ndarray, members: np.ndarray, base: float = 1.05, max_children: int = 16,
              leaf_size: int = 8, root_centre: int | None = None, root_level: int | None = None) -> "SGTree":
        members = np.asarray(members, dtype=np.int64)
        if base <= 1:
            raise ValueError("the SG tree's base must be > 1")
        centre0 = int(members[0] if root_centre is None else root_centre)
        dist0 = np.linalg.norm(points[members] - points[centre0], axis=1)
        radius0 = float(dist0.max()) if len(members) else 0.0
        level0 = int(math.ceil(math.log(max(radius0, 1e-30)) / math.log(base))) if root_level is None else root_level
        if radius0 > base ** level0 * (1 + 1e-9):
            raise ValueError("the root's points do not fit its level")
        # the root centre first in its range (nesting: a node's first child is the node's own centre)
        perm = np.concatenate([[centre0], members[members != centre0]]) if len(members) else members
        nodes = {k: [v] for k, v in dict(centre=centre0, level=level0, radius=radius0, start=0, end=len(perm),
                                         parent=-1).items()}
        child_lo, child_hi = [0], [0]
        frontier = [0] if len(perm) > leaf_size and radius0 > 0 else []
        while frontier:
            frontier = cls._split_round(points, perm, frontier, nodes, child_lo, child_hi, base, max_children,
                                        leaf_size)
        arrays = {k: np.asarray(v) for k, v in nodes.items()}
        return cls(base=base, centre=arrays["centre"].astype(np.int64), level=arrays["level"].astype(np.int64),
                   radius=arrays["radius"].astype(np.float64), start=arrays["start"].astype(np.int64),
                   end=arrays["end"].astype(np.int64), child_lo=np.asarray(child_lo, np.int64),
                   child_hi=np.asarray(child_hi, np.int64), parent=arrays["parent"].astype(np.int64), order=perm)

    @staticmethod
    def _split_round(points, perm, frontier, nodes, child_lo, child_hi, base, max_children, leaf_size) -> list[int]:
        """Split every node of `frontier` at once (one farthest-first net per node, vectorised over all of them);
        appends the children (contiguous per parent) and returns those still to split."""
        f = np.asarray(frontier)
        starts, ends = np.asarray(nodes["start"])[f], np.asarray(nodes["end"])[f]
        counts = ends - starts
        pos = _range_positions(starts, counts)
        seg = np.repeat(np.arange(len(f)), counts)  # which frontier node each position belongs to
        ids = perm[pos]
        vecs = points[ids]
        first = points[np.asarray(nodes["centre"])[f]]
        mind = np.linalg.norm(vecs - first[seg], axis=1)
        assign = np.zeros(len(pos), np.int64)
        centres = [[int(c)] for c in np.asarray(nodes["centre"])[f]]
        delta = np.full(len(f), np.inf)  # distance at which each node's last centre was chosen
        need = np.asarray(nodes["level"])[f] - 1
        threshold = base ** need.astype(np.float64)
        running = np.ones(len(f), bool)
        seg_starts = _segment_starts(seg)
        while running.any():
            segmax = np.maximum.reduceat(mind, seg_starts)
            taken = np.array([len(c) for c in centres])
            running &= (segmax > 0) & ((taken < max_children) | (segmax > threshold))
            if not running.any():
                break
            candidates = np.where(mind == segmax[seg], np.arange(len(pos)), len(pos))
            best = np.minimum.reduceat(candidates, seg_starts)
            for node in np.flatnonzero(running):
                centres[node].append(int(ids[best[node]]))
            delta[running] = segmax[running]
            active = np.flatnonzero(running[seg])
            new_centre = points[ids[best[seg[active]]]]
            d = np.linalg.norm(vecs[active] - new_centre, axis=1)
            closer = d < mind[active]
            mind[active[closer]] = d[closer]
            assign[active[closer]] = taken[seg[active[closer]]]
        # reorder each node's range by child (each child's centre first in its range, then by position)
        width = max(len(c) for c in centres)
        table = np.full((len(f), width), -1, np.int64)
        for node, cs in enumerate(centres):
            table[node, :len(cs)] = cs
        not_centre = ids != table[seg, assign]
        key = np.lexsort((np.arange(len(pos)), not_centre, assign, seg))
        perm[pos] = ids[key]
        assign_sorted, mind_sorted = assign[key], mind[key]
        next_frontier = []
        for node_i, node in enumerate(frontier):
            cs = centres[node_i]
            if len(cs) == 1:  # all points coincide with the centre: a leaf bucket
                continue
            lo = len(nodes["centre"])
            child_lo[node], child_hi[node] = lo, lo + len(cs)
            level = int(min(_floor_log(np.array([delta[node_i]]), base)[0] + 1, nodes["level"][node] - 1))
            mask = slice(seg_starts[node_i], seg_starts[node_i] + counts[node_i])
            a, m = assign_sorted[mask], mind_sorted[mask]
            sizes = np.bincount(a, minlength=len(cs))
            radii = np.zeros(len(cs))
            np.maximum.at(radii, a, m)
            offset = int(starts[node_i])
            for j, c in enumerate(cs):
                idx = len(nodes["centre"])
                nodes["centre"].append(c)
                nodes["level"].append(level)
                nodes["radius"].append(float(radii[j]))
                nodes["start"].append(offset)
                nodes["end"].append(offset + int(sizes[j]))
                nodes["parent"].append(node)
                child_lo.append(0)
                child_hi.append(0)
                offset += int(sizes[j])
                if sizes[j] > leaf_size and radii[j] > 0:
                    next_frontier.append(idx)
        return next_frontier

    # -- queries ----------------------------------------------------------------------------------------------

    def members(self, node: int) -> np.ndarray:
        return self.order[self.start[node]:self.end[node]]

    def children(self, node: int) -> range:
        return range(int(self.child_lo[node]), int(self.child_hi[node]))

    def depth_groups(self) -> list[np.ndarray]:
        """Nodes by depth (root first); nodes of one depth have disjoint ranges."""
        groups, current = [], np.array([0])
        while len(current):
            groups.append(current)
            lo, hi = self.child_lo[current], self.child_hi[current]
            current = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)]) if (hi > lo).any() else np.zeros(0, int)
        return groups

    def measured_radii(self, points: np.ndarray) -> np.ndarray:
        """maxd of every node over `points` (vectorised per depth)."""
        radius = np.zeros(len(self.centre))
        for group in self.depth_groups():
            counts = self.end[group] - self.start[group]
            keep = counts > 0
            group, counts = group[keep], counts[keep]
            pos = _range_positions(self.start[group], counts)
            owner = np.repeat(group, counts)
            d = np.linalg.norm(points[self.order[pos]] - points[self.centre[owner]], axis=1)
            radius[group] = np.maximum.reduceat(d, np.concatenate([[0], np.cumsum(counts)[:-1]]))
        return radius

    def min_sibling_distance(self, points: np.ndarray) -> np.ndarray:
        """mind of every node: the smallest distance between two of its children (inf: fewer than two)."""
        out = np.full(len(self.centre), np.inf)
        for node in np.flatnonzero(self.child_hi - self.child_lo > 1):
            c = points[self.centre[self.child_lo[node]:self.child_hi[node]]]
            sq = (c * c).sum(1)
            d2 = sq[:, None] + sq[None, :] - 2 * c @ c.T
            np.fill_diagonal(d2, np.inf)
            out[node] = math.sqrt(max(float(d2.min()), 0.0))
        return out

    # -- maintenance (Alg. 3) ---------------------------------------------------------------------------------

    def update(self, points: np.ndarray, bound: float | None = None, max_children: int = 16,
               leaf_size: int = 8) -> "SGTree":
        """The tree for moved `points` (same point ids). With `bound` U (the paper's 4 w eta beta L M: no pairwise
        distance changed by more than U), the tests are the paper's: a node keeps covering if maxd + U <= b^l and
        its children keep separation if mind - U >= b^(l-1), with maxd / mind as stored before the move.
        Without it, maxd and mind are measured on the moved points. A failing node's subtree is rebuilt from its
        nearest ancestor that still covers its points (same centre and level, so it re-attaches under the same
        parent); if the root fails, the whole tree is rebuilt. Stored radii are re-measured afterwards."""
        if bound is None:
            radius, mind = self.measured_radii(points), self.min_sibling_distance(points)
            covers = radius <= self.base ** self.level.astype(np.float64) * (1 + 1e-12)
        else:
            if self.mind is None:
                raise ValueError("mind was never measured: call tree.remember_mind(points) after building")
            radius, mind = self.radius + bound, self.mind - bound
            covers = radius <= self.base ** self.level.astype(np.float64)
        child_level = np.where(self.child_hi > self.child_lo,
                               self.level[np.minimum(self.child_lo, len(self.level) - 1)], 0)
        separates = mind >= self.base ** (child_level - 1).astype(np.float64) * (1 - 1e-12)
        roots = set()
        for node in np.flatnonzero(~covers | ~separates):
            a = int(node) if covers[node] else int(self.parent[node])
            while a >= 0 and not covers[a]:
                a = int(self.parent[a])
            if a < 0:
                tree = SGTree.build(points, self.order, self.base, max_children, leaf_size)
                tree.rebuilt_points = len(self.order)
                return tree.remember_mind(points)
            roots.add(a)
        roots = self._outermost(roots)
        subtrees = {r: SGTree.build(points, self.members(r), self.base, max_children, leaf_size,
                                    root_centre=int(self.centre[r]), root_level=int(self.level[r])) for r in roots}
        tree = self._assemble(subtrees)
        tree.radius = tree.measured_radii(points)
        tree.rebuilt_points = int(sum(self.end[r] - self.start[r] for r in roots))
        return tree.remember_mind(points)

    def _outermost(self, roots: set[int]) -> list[int]:
        out = []
        for r in sorted(roots):
            a, inside = int(self.parent[r]), False
            while a >= 0:
                if a in roots:
                    inside = True
                    break
                a = int(self.parent[a])
            if not inside:
                out.append(r)
        return out

    def _assemble(self, subtrees: dict[int, "SGTree"]) -> "SGTree":
        """A new tree (breadth first) with the subtree of each key replaced by its value, re-attached in place."""
        new = {k: [] for k in ("centre", "level", "radius", "start", "end", "parent", "child_lo", "child_hi")}
        order = self.order.copy()
        for r, sub in subtrees.items():
            order[self.start[r]:self.end[r]] = sub.order
        queue = [(self, 0, -1, 0)]  # (source tree, node, new parent, offset of the source's order in `order`)
        head = 0
        while head < len(queue):
            src, node, parent, offset = queue[head]
            if src is self and node in subtrees:
                src, node, offset = subtrees[node], 0, int(self.start[node])
            new["centre"].append(src.centre[node])
            new["level"].append(src.level[node])
            new["radius"].append(src.radius[node])
            new["start"].append(src.start[node] + offset)
            new["end"].append(src.end[node] + offset)
            new["parent"].append(parent)
            kids = src.children(node)
            lo = len(queue)
            new["child_lo"].append(lo if len(kids) else 0)
            new["child_hi"].append(lo + len(kids) if len(kids) else 0)
            queue.extend((src, k, head, offset) for k in kids)
            head += 1
        a = {k: np.asarray(v) for k, v in new.items()}
        return SGTree(self.base, a["centre"].astype(np.int64), a["level"].astype(np.int64), a["radius"].astype(float),
                      a["start"].astype(np.int64), a["end"].astype(np.int64), a["child_lo"].astype(np.int64),
                      a["child_hi"].astype(np.int64), a["parent"].astype(np.int64), order)

    def remember_mind(self, points: np.ndarray) -> "SGTree":
        self.mind = self.min_sibling_distance(points)
        return self

    # -- checkpoints ------------------------------------------------------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        out = {k: getattr(self, k) for k in FIELDS}
        out["mind"] = np.zeros(0) if self.mind is None else self.mind
        out["base"] = np.array([self.base])
        return out

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> "SGTree":
        return cls(float(a["base"][0]), *(np.asarray(a[k]) for k in FIELDS),
                   mind=np.asarray(a["mind"]) if len(a["mind"]) else None)


def check_invariants(tree: SGTree, points: np.ndarray, tol: float = 1e-9) -> list[str]:
    """Violations of nesting, covering (radius is the true maxd and <= b^level) and sibling separation, plus
    whether the leaves partition the tree's points; an empty list when the tree is valid."""
    wrong = []
    base = tree.base
    leaves = []
    for node in range(len(tree.centre)):
        pts = tree.members(node)
        if tree.centre[node] != pts[0]:
            wrong.append(f"node {node}: its centre is not the first of its points")
        d = np.linalg.norm(points[pts] - points[tree.centre[node]], axis=1)
        if abs(d.max() - tree.radius[node]) > tol:
            wrong.append(f"node {node}: stored radius {tree.radius[node]} != maxd {d.max()}")
        if d.max() > base ** tree.level[node] + tol:
            wrong.append(f"node {node}: maxd {d.max()} > b^{tree.level[node]}")
        kids = list(tree.children(node))
        if not kids:
            leaves.append(pts)
            continue
        if tree.centre[kids[0]] != tree.centre[node]:
            wrong.append(f"node {node}: first child does not share its centre (nesting)")
        if tree.start[kids[0]] != tree.start[node] or tree.end[kids[-1]] != tree.end[node] or any(
                tree.end[a] != tree.start[b] for a, b in zip(kids, kids[1:])):
            wrong.append(f"node {node}: children do not tile its points")
        for k in kids:
            if tree.level[k] >= tree.level[node] or tree.parent[k] != node:
                wrong.append(f"node {k}: level / parent inconsistent with node {node}")
        c = points[tree.centre[kids]]
        pair = np.linalg.norm(c[:, None] - c[None, :], axis=2) + np.eye(len(kids)) * 1e30
        if len(kids) > 1 and pair.min() < base ** (tree.level[kids[0]] - 1) - tol:
            wrong.append(f"node {node}: siblings {pair.min()} apart < b^{tree.level[kids[0]] - 1}")
    flat = np.sort(np.concatenate(leaves))
    if not np.array_equal(flat, np.sort(tree.order)):
        wrong.append("the leaves do not partition the points")
    return wrong


# -- clusterings and samplers -------------------------------------------------------------------------------------


@dataclass
class Clustering:
    """A set of clusters of a forest's targets (FindClustering's frontier: a partition of all of them), for one
    query. Cluster c: representative `rep[c]` (its node's centre), its targets `members[c]`, its radius and the
    depth of its node below its tree's root."""

    rep: np.ndarray  # [C] point id of each cluster's representative
    radius: np.ndarray  # [C]
    members: list[np.ndarray]  # point ids of each cluster
    rep_score: np.ndarray  # [C] <q, rep>
    depth: np.ndarray  # [C] edges from the tree's root to the cluster's node (0: the root itself)

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(m) for m in self.members])

    def cluster_of(self, total: int) -> np.ndarray:
        """[total] cluster index of every point (-1: in no cluster)."""
        out = np.full(total, -1)
        for c, m in enumerate(self.members):
            out[m] = c
        return out

    def closest(self, k: int, points: np.ndarray, query: np.ndarray) -> "Clustering":
        """The k clusters whose representatives are closest to the query (the paper's practical recipe samples
        from those only); all of them when k is 0 or at least their number. Ties go to the earlier cluster."""
        if k <= 0 or k >= len(self.rep):
            return self
        keep = np.sort(np.argsort(np.linalg.norm(points[self.rep] - query, axis=1), kind="stable")[:k])
        return Clustering(rep=self.rep[keep], radius=self.radius[keep], members=[self.members[c] for c in keep],
                          rep_score=self.rep_score[keep], depth=self.depth[keep])


def start_level(allowed_error: float, beta: float, base: float) -> Optional[int]:
    """Alg. 2, line 3: l = max{l in Z : b^l <= log(gamma) / (2 beta)}, the coarsest level whose clustering keeps
    max_y P(y|x) / Q(y|x) <= gamma (Prop. 2: a cluster of radius b^l moves a score by at most b^l, the ratio by
    e^(2 beta b^l)). None for gamma = 0 (no bound: the frontier starts at the roots); gamma must otherwise be > 1."""
    if allowed_error == 0:
        return None
    if not allowed_error > 1:
        raise ValueError(f"the allowed error gamma must be > 1 (a bound on P / Q), got {allowed_error}")
    bound = math.log(allowed_error) / (2 * beta)
    level = math.floor(math.log(bound) / math.log(base))
    while base ** (level + 1) <= bound:  # exact max{} despite rounding in the logarithms
        level += 1
    while base ** level > bound:
        level -= 1
    return level


def find_clustering(forest: list[SGTree], points: np.ndarray, query: np.ndarray, deepest: int = -14,
                    max_clusters: int = 100, start: Optional[int] = None) -> Clustering:
    """Algorithm 2 (FindClustering) on every tree of a forest, each tree's frontier capped at `max_clusters`
    clusters (the paper's cap for its single tree). A tree's frontier starts at its root; nodes above level
    `start` (Alg. 2's l, see `start_level`; None: none) are expanded first, as the frontier is initialised to
    the clustering at level l; then the frontier node whose targets can score highest (<q, centre> + ||q|| maxd)
    is replaced by its children, as long as the tree's frontier stays within the cap. Below l, nodes at level
    <= `deepest` (m) are not expanded, nor nodes frozen by the paper's rule ||q - centre|| > b^level + b^m (all
    their targets are farther than b^m from q). An expansion over the cap is skipped (the node stays one
    cluster; smaller expansions may still fit). The frontiers together are a partition of all targets."""
    qnorm = float(np.linalg.norm(query))
    heap: list[tuple[int, float, int, int]] = []
    size = [1] * len(forest)  # clusters on each tree's frontier
    depth = {(t, 0): 0 for t in range(len(forest))}  # the roots

    def push(t: int, node: int) -> None:
        tree = forest[t]
        if tree.child_hi[node] == tree.child_lo[node]:
            return
        c = points[tree.centre[node]]
        bound = float(query @ c) + qnorm * tree.radius[node]
        if start is not None and tree.level[node] > start:
            heapq.heappush(heap, (0, -bound, t, node))  # above l: part of the initial clustering's descent
            return
        reach = tree.base ** tree.level[node] + tree.base ** deepest
        if tree.level[node] <= deepest or np.linalg.norm(query - c) > reach:
            return
        heapq.heappush(heap, (1, -bound, t, node))

    for t in range(len(forest)):
        push(t, 0)
    while heap:
        _, _, t, node = heapq.heappop(heap)
        kids = forest[t].children(node)
        if size[t] - 1 + len(kids) > max_clusters:
            continue
        size[t] += len(kids) - 1
        below = depth.pop((t, node)) + 1
        for k in kids:
            depth[(t, k)] = below
            push(t, k)
    chosen = sorted(depth)
    rep = np.array([forest[t].centre[n] for t, n in chosen], dtype=np.int64)
    return Clustering(rep=rep, radius=np.array([forest[t].radius[n] for t, n in chosen]),
                      members=[forest[t].members(n) for t, n in chosen], rep_score=points[rep] @ query,
                      depth=np.array([depth[key] for key in chosen], dtype=np.int64))


def proposal_logits(clustering: Clustering, beta: float) -> np.ndarray:
    """log of the unnormalised cluster weights |C| e^(beta <q, rep C>) of Q(y|x)."""
    return np.log(clustering.sizes) + beta * clustering.rep_score


def proposal_probabilities(clustering: Clustering, beta: float, total: int) -> np.ndarray:
    """Q(y|x) for every target (0 outside the clustering): e^(beta <q, rep(C_y)>) / sum_C |C| e^(beta <q, rep C>)."""
    logits = proposal_logits(clustering, beta)
    cluster_p = np.exp(logits - logits.max())
    cluster_p /= cluster_p.sum()
    q = np.zeros(total)
    for c, m in enumerate(clustering.members):
        q[m] = cluster_p[c] / len(m)
    return q


def _draw_clusters(logits: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    p = np.exp(logits - logits.max())
    return rng.choice(len(p), size=count, p=p / p.sum())


def _draw_members(clustering: Clustering, clusters: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    sizes = clustering.sizes
    picks = (rng.random(len(clusters)) * sizes[clusters]).astype(np.int64)
    return np.array([clustering.members[c][i] for c, i in zip(clusters, picks)], dtype=np.int64)


def sample_proposal(clustering: Clustering, beta: float, count: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`count` draws from Q(y|x): (targets, their clusters)."""
    clusters = _draw_clusters(proposal_logits(clustering, beta), count, rng)
    return _draw_members(clustering, clusters, rng), clusters


def rejection_sample(clustering: Clustering, points: np.ndarray, query: np.ndarray, beta: float, count: int,
                     rng: np.random.Generator, max_rounds: int = 10_000) -> np.ndarray:
    """Exact samples from the softmax P(y|x) ∝ e^(beta <q, y>) over the clustering's targets (Alg. 1's rejection
    step): propose a cluster ∝ |C| e^(beta (<q, rep> + ||q|| r_C)) — an upper bound on every member's weight by
    covering and Cauchy-Schwarz — and a member uniformly, accept with e^(beta (<q, y> - <q, rep> - ||q|| r_C))."""
    slack = float(np.linalg.norm(query)) * clustering.radius
    logits = np.log(clustering.sizes) + beta * (clustering.rep_score + slack)
    out = []
    for _ in range(max_rounds):
        clusters = _draw_clusters(logits, 2 * count, rng)
        targets = _draw_members(clustering, clusters, rng)
        log_accept = beta * (points[targets] @ query - clustering.rep_score[clusters] - slack[clusters])
        out.extend(targets[np.log(rng.random(len(targets))) < log_accept].tolist())
        if len(out) >= count:
            return np.array(out[:count], dtype=np.int64)
    raise RuntimeError("rejection sampling did not finish: the bound is too loose for this beta")


def metropolis_hastings(clustering: Clustering, points: np.ndarray, query: np.ndarray, beta: float, chains: int,
                        steps: int, rng: np.random.Generator) -> np.ndarray:
    """Independent Metropolis-Hastings with the cluster proposal (the sampler the paper runs): each chain starts
    from a draw of Q and takes `steps` proposals y' ~ Q, accepted with
    min(1, e^(beta (s' - s)) e^(beta (s^ - s^'))) where s^ is the score of the target's cluster representative.
    Returns the final state of every chain, [chains]."""
    logits = proposal_logits(clustering, beta)
    state, state_cluster = sample_proposal(clustering, beta, chains, rng)
    for _ in range(steps):
        clusters = _draw_clusters(logits, chains, rng)
        proposal = _draw_members(clustering, clusters, rng)
        log_ratio = beta * ((points[proposal] @ query - points[state] @ query)
                            + (clustering.rep_score[state_cluster] - clustering.rep_score[clusters]))
        accept = np.log(rng.random(chains)) < log_ratio
        state = np.where(accept, proposal, state)
        state_cluster = np.where(accept, clusters, state_cluster)
    return state


def build_forest(points: np.ndarray, trees: int, rng: np.random.Generator, base: float = 1.05,
                 max_children: int = 16, leaf_size: int = 8) -> list[SGTree]:
    """`trees` SG trees over a random partition of the points into parts of (almost) equal size."""
    parts = np.array_split(rng.permutation(len(points)), max(1, min(trees, len(points))))
    return [SGTree.build(points, np.sort(part), base, max_children, leaf_size).remember_mind(points) for part in parts]

"""Dynnibal (seed 001): SG-tree invariants against brute-force distances, FindClustering against a brute-force walk
of the trees (it expands, each tree's frontier within its cap, a partition) and Alg. 2's start level, the proposal
against a hand computation, the exact sampler against the softmax (chi-square), MH against its exact n-step
distribution and the independent-MH bound, Nyström exactness and drift recovery, the config checks, and Algorithm 1
end to end: metrics.json, a bitwise resume, the warm-start / full-refresh schedule against a hand count, and SIGKILLs
across both resumed bitwise."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from scipy import stats

from rag_train.buffer import nystrom
from rag_train.buffer.sg_tree import (
    SGTree,
    build_forest,
    find_clustering,
    metropolis_hastings,
    proposal_probabilities,
    rejection_sample,
    start_level,
)
from rag_train.config import ConfigError
from rag_train.strategies.dynnibal import DynnibalConfig
from rag_train.train.retriever import train_retriever

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_faults import FAULTY, results, run_script
from test_train_retriever import (
    CONFIG,
    LANDMARKS,
    NYSTROM_SAMPLES,
    PASSAGES,
    REFRESH,
    STEPS,
    config,
    overrides,
    weights,
)


def unit(rng, n, d):
    x = rng.standard_normal((n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def clustered(rng, n, d, centres=6, spread=0.15):
    c = unit(rng, centres, d)
    return c[rng.integers(centres, size=n)] + spread * rng.standard_normal((n, d)) / np.sqrt(d)


def violations(tree: SGTree, points: np.ndarray, members: np.ndarray, tol=1e-6) -> list[str]:
    """Independent brute-force check: walk the tree from the root through child lists only."""
    wrong, leaf_points = [], []
    stack = [0]
    while stack:
        node = stack.pop()
        under = tree.order[tree.start[node]:tree.end[node]]
        d = np.sqrt(((points[under] - points[tree.centre[node]]) ** 2).sum(1))
        if abs(d.max() - tree.radius[node]) > tol or d.max() > tree.base ** tree.level[node] + tol:
            wrong.append(f"covering at node {node}")
        kids = list(range(tree.child_lo[node], tree.child_hi[node]))
        if not kids:
            leaf_points.extend(under.tolist())
            continue
        if tree.centre[kids[0]] != tree.centre[node] or any(tree.level[k] >= tree.level[node] for k in kids):
            wrong.append(f"nesting at node {node}")
        children = np.concatenate([tree.order[tree.start[k]:tree.end[k]] for k in kids])
        if sorted(children.tolist()) != sorted(under.tolist()):
            wrong.append(f"children of {node} do not partition its points")
        for i in kids:
            for j in kids:
                apart = np.linalg.norm(points[tree.centre[i]] - points[tree.centre[j]])
                if i < j and apart < tree.base ** (tree.level[i] - 1) - tol:
                    wrong.append(f"separation between siblings {i}, {j}")
        stack.extend(kids)
    if sorted(leaf_points) != sorted(members.tolist()):
        wrong.append("leaves do not hold every point exactly once")
    return wrong


@pytest.mark.parametrize("base,children,leaf", [(1.05, 4, 3), (1.3, 8, 1), (2.0, 3, 5)])
def test_tree_invariants_after_build(base, children, leaf):
    rng = np.random.default_rng(0)
    points = np.concatenate([clustered(rng, 300, 6), np.repeat(unit(rng, 2, 6), 4, axis=0)])  # with duplicates
    members = np.sort(rng.choice(len(points), 250, replace=False))
    tree = SGTree.build(points, members, base, children, leaf)
    assert violations(tree, points, members) == []
    assert len(tree.centre) > 10  # a real hierarchy, not one flat bucket
    # the invariants can fail: a moved centre breaks covering
    moved = points.copy()
    moved[tree.centre[0]] += 10
    assert violations(tree, moved, members)


def test_invariants_hold_after_updates_within_the_bound():
    rng = np.random.default_rng(1)
    points = clustered(rng, 400, 8)
    members = np.arange(len(points))
    tree = SGTree.build(points, members, 1.1, 6, 4).remember_mind(points)
    for bound in (1e-3, 0.02, 0.2):
        step = rng.standard_normal(points.shape)
        step *= (bound / 2) / np.linalg.norm(step, axis=1, keepdims=True) * rng.random((len(points), 1))
        moved = points + step  # every point moves <= U/2: no pairwise distance changes by more than U
        updated = tree.update(moved, bound=bound, max_children=6, leaf_size=4)
        assert violations(updated, moved, members) == []
        if bound == 1e-3:
            assert 0 < updated.rebuilt_points < len(points)  # only the subtrees that fail the tests
        tree, points = updated, moved
    # measured (no bound): larger, arbitrary moves
    moved = points + 0.3 * rng.standard_normal(points.shape)
    assert violations(tree.update(moved), moved, members) == []


def walk(tree: SGTree, node: int, query: np.ndarray, points: np.ndarray, deepest: int, start) -> list[int]:
    """Brute force, without a cap: Alg. 2's clustering under `node` by recursion through child lists (nodes
    above `start` always split; below, a node splits unless it is at level <= deepest or frozen)."""
    kids = list(range(tree.child_lo[node], tree.child_hi[node]))
    if not kids:
        return [node]
    above = start is not None and tree.level[node] > start
    frozen = np.linalg.norm(query - points[tree.centre[node]]) > tree.base ** tree.level[node] + tree.base ** deepest
    if not above and (tree.level[node] <= deepest or frozen):
        return [node]
    return [leaf for k in kids for leaf in walk(tree, k, query, points, deepest, start)]


def under(tree: SGTree, node: int) -> list[int]:
    """The points under a node: its leaf buckets, reached through child lists."""
    kids = range(tree.child_lo[node], tree.child_hi[node])
    return tree.members(node).tolist() if not len(kids) else [p for k in kids for p in under(tree, k)]


def as_sets(clusters) -> set[frozenset]:
    return {frozenset(m) for m in clusters}


def test_find_clustering_expands_to_the_brute_force_walk_and_is_a_partition():
    rng = np.random.default_rng(2)
    points = clustered(rng, 600, 8)
    forest = build_forest(points, 3, rng, 1.05, 5, 4)
    query = points[11]
    for deepest, start in [(-14, None), (-3, None), (-14, 2)]:
        expected = [(t, n) for t, tree in enumerate(forest) for n in walk(tree, 0, query, points, deepest, start)]
        whole = find_clustering(forest, points, query, deepest, max_clusters=10**9, start=start)
        assert as_sets(whole.members) == as_sets(under(forest[t], n) for t, n in expected)
        assert len(whole.rep) > 3 * 5  # it expanded beyond the roots' children
        depth = {(t, 0): 0 for t in range(3)}
        for t, tree in enumerate(forest):  # depth of every node by walking from the root
            for n in range(1, len(tree.centre)):
                depth[(t, n)] = depth[(t, int(tree.parent[n]))] + 1
        assert sorted(whole.depth.tolist()) == sorted(depth[key] for key in expected)
    # capped: each tree's frontier grows from its root up to the cap, never past it, still a partition
    for cap in (5, 12, 40):
        clustering = find_clustering(forest, points, query, max_clusters=cap)
        counts = np.bincount(np.concatenate(clustering.members), minlength=len(points))
        assert (counts == 1).all()  # every target in exactly one cluster
        owner = {frozenset(under(tree, n)): t for t, tree in enumerate(forest) for n in range(len(tree.centre))}
        per_tree = np.bincount([owner[frozenset(m.tolist())] for m in clustering.members], minlength=3)
        assert (per_tree <= cap).all() and (per_tree > 1).all()  # every tree expanded, within the cap
        assert per_tree.sum() > cap - 5  # and used most of it (an expansion adds at most children - 1 < 5)
        assert clustering.depth.max() >= 1
    # the closest k clusters: by the representative's distance to the query, against a brute-force sort
    clustering = find_clustering(forest, points, query, max_clusters=40)
    near = clustering.closest(7, points, query)
    distance = np.linalg.norm(points[clustering.rep] - query, axis=1)
    assert set(near.rep.tolist()) == set(clustering.rep[np.argsort(distance)[:7]].tolist())
    assert as_sets(near.members) <= as_sets(clustering.members) and len(near.members) == 7
    assert clustering.closest(0, points, query) is clustering


def test_find_clustering_is_a_partition_and_the_proposal_is_the_papers():
    rng = np.random.default_rng(2)
    points = clustered(rng, 500, 8)
    forest = build_forest(points, 3, rng, 1.05, 5, 4)
    query, beta = points[7], 12.0  # a query among the targets: far ones (e.g. 3 x points[7]) freeze every root
    for cap in (20, 60):
        clustering = find_clustering(forest, points, query, deepest=-14, max_clusters=cap)
        assert 3 < len(clustering.rep) <= 3 * cap  # it expanded; each tree's frontier within the cap
        counts = np.bincount(np.concatenate(clustering.members), minlength=len(points))
        assert (counts == 1).all()  # every target in exactly one cluster
        q = proposal_probabilities(clustering, beta, len(points))
        assert q.sum() == pytest.approx(1.0, abs=1e-12)
        # by hand: Q(y|x) = e^(beta <q, rep(C_y)>) / sum_C |C| e^(beta <q, rep C>)
        owner = clustering.cluster_of(len(points))
        rep_score = points[clustering.rep] @ query
        z = sum(len(m) * np.exp(beta * s) for m, s in zip(clustering.members, rep_score))
        np.testing.assert_allclose(q, np.exp(beta * rep_score[owner]) / z, rtol=1e-10)
        # covering: every member scores within ||q|| r of its representative
        gap = np.abs(points @ query - rep_score[owner])
        assert (gap <= np.linalg.norm(query) * clustering.radius[owner] + 1e-9).all()
    assert len(find_clustering(forest, points, query, 20, 1000).rep) == 3  # deepest level above the roots


def test_start_level_is_the_papers_max_and_bounds_the_clusters():
    for beta, base in [(20.0, 1.05), (2.0, 1.5), (7.0, 2.0)]:
        for log_gamma in (0.01, 1.0, 13.5, 40.0, 80.0):
            bound = log_gamma / (2 * beta)
            brute = max(level for level in range(-400, 400) if base ** level <= bound)
            assert start_level(float(np.exp(log_gamma)), beta, base) == brute
    assert start_level(float(np.exp(2 * 2.0 * 1.5 ** 3)), 2.0, 1.5) in (2, 3)  # b^l = bound exactly: rounding
    assert start_level(0.0, 20.0, 1.05) is None
    with pytest.raises(ValueError, match="gamma must be > 1"):
        start_level(0.5, 20.0, 1.05)
    # the frontier at level l: every cluster has level <= l or is a leaf, so P / Q <= e^(2 beta b^l) <= gamma
    rng = np.random.default_rng(7)
    points = clustered(rng, 400, 6)
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    forest = build_forest(points, 2, rng, 1.2, 4, 3)
    beta, gamma = 3.0, float(np.exp(2 * 3.0 * 0.3))
    level = start_level(gamma, beta, 1.2)
    query = points[5]
    clustering = find_clustering(forest, points, query, deepest=level, max_clusters=10**9, start=level)
    tree_of = {frozenset(under(tree, n)): (tree, n) for tree in forest for n in range(len(tree.centre))}
    for members in clustering.members:
        tree, n = tree_of[frozenset(members.tolist())]
        assert tree.level[n] <= level or tree.child_hi[n] == tree.child_lo[n]
    p = softmax(points, query, beta)
    q = proposal_probabilities(clustering, beta, len(points))
    assert (p / q).max() <= gamma * (1 + 1e-9)
    roots = find_clustering(forest, points, query, deepest=level, max_clusters=10**9)
    assert len(clustering.rep) > len(roots.rep)  # starting at l splits more than starting at the roots


def softmax(points, query, beta):
    s = beta * (points @ query)
    p = np.exp(s - s.max())
    return p / p.sum()


def small_problem(seed, rows, centres, trees, base, leaf, query_row, cap):
    """A clustered toy set, a forest over it, one query and its clustering (cap clusters at most)."""
    rng = np.random.default_rng(seed)
    points = clustered(rng, rows, 4, centres=centres)
    forest = build_forest(points, trees, rng, base, 3, leaf)
    return rng, points, points[query_row], find_clustering(forest, points, points[query_row], max_clusters=cap)


def test_rejection_sampler_matches_the_softmax():
    rng, points, query, clustering = small_problem(3, 40, 4, 2, 1.2, 3, 0, 6)
    beta = 3.0
    draws = rejection_sample(clustering, points, query, beta, 20000, rng)
    expected = softmax(points, query, beta) * len(draws)
    _, p_value = stats.chisquare(np.bincount(draws, minlength=len(points)), expected)
    assert p_value > 1e-3
    # the proposal alone is not the softmax (so the test can tell them apart)
    proposal = proposal_probabilities(clustering, beta, len(points))
    assert np.abs(proposal - softmax(points, query, beta)).sum() > 0.05


def test_metropolis_hastings_reaches_the_tv_bound():
    rng, points, query, clustering = small_problem(4, 30, 3, 1, 1.3, 4, 3, 4)
    beta = 2.0
    p, q = softmax(points, query, beta), proposal_probabilities(clustering, beta, len(points))
    # exact transition matrix of independent MH with target P and proposal Q
    accept = np.minimum(1.0, (p[None, :] * q[:, None]) / (p[:, None] * q[None, :]))
    kernel = q[None, :] * accept
    np.fill_diagonal(kernel, 0)
    kernel[np.diag_indices_from(kernel)] = 1 - kernel.sum(1)
    w_star = (p / q).max()  # independent MH: TV after n steps <= (1 - 1/w*)^n (Mengersen and Tweedie 1996)
    dist = q.copy()
    for steps in range(1, 6):
        dist = dist @ kernel
        assert 0.5 * np.abs(dist - p).sum() <= (1 - 1 / w_star) ** steps + 1e-12
    # the sampler draws from that exact 2-step distribution
    two = q @ kernel @ kernel
    states = metropolis_hastings(clustering, points, query, beta, 40000, 2, rng)
    empirical = np.bincount(states, minlength=len(points)) / len(states)
    assert 0.5 * np.abs(empirical - two).sum() < 0.03
    assert 0.5 * np.abs(two - p).sum() < 0.5 * np.abs(q - p).sum()  # and two steps got closer to P than Q


def test_nystrom_is_exact_when_the_landmarks_span_the_space():
    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((200, 6))
    projection = nystrom.whitening(vectors[:10])  # 10 landmarks spanning R^6
    low = nystrom.represent(vectors, projection).astype(np.float64)
    np.testing.assert_allclose(nystrom.reconstruct(low, projection), vectors, atol=1e-5)
    np.testing.assert_allclose(low @ low.T, vectors @ vectors.T, atol=1e-4)  # inner products (the kernel)
    d = np.linalg.norm(low[:, None] - low[None], axis=2)
    np.testing.assert_allclose(d, np.linalg.norm(vectors[:, None] - vectors[None], axis=2), atol=1e-4)
    few = nystrom.whitening(vectors[:3])  # 3 landmarks do not span R^6: an approximation only
    assert np.abs(nystrom.reconstruct(nystrom.represent(vectors, few), few) - vectors).max() > 0.1


def test_regression_recovers_a_linear_drift():
    rng = np.random.default_rng(6)
    vectors = rng.standard_normal((500, 8))
    drift = np.eye(8) + 0.3 * rng.standard_normal((8, 8))
    landmarks = np.arange(16)
    low = nystrom.represent(vectors, nystrom.whitening(vectors[landmarks])).astype(np.float64)
    sample = rng.choice(500, 40, replace=False)
    moved = vectors @ drift.T  # the encoder after w steps, as a linear map
    regression = nystrom.fit_regression(low[sample], moved[sample], ridge=1e-12)
    np.testing.assert_allclose(low @ regression, moved, atol=1e-5)  # every target, from 40 re-encoded ones
    new_projection = nystrom.whitening(moved[landmarks])
    new_low = nystrom.reencode(low, regression, new_projection).astype(np.float64)
    np.testing.assert_allclose(new_low @ new_low.T, moved @ moved.T, atol=1e-3)


@pytest.mark.parametrize("key,value", [("landmarks", 0), ("nystrom_samples", -1), ("trees", 0), ("mh_chains", 0),
                                        ("tree_base", 1.0), ("max_clusters", 0), ("nystrom_ridge", -1.0),
                                        ("allowed_error", 0.5), ("top_clusters", -1), ("sampling_temperature", -0.1),
                                        ("warm_start_steps", -1), ("full_refresh_step", 4000)])
def test_config_errors_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"strategy.{key}"):
        DynnibalConfig(name="dynnibal", **{key: value})


def test_a_forest_that_could_never_expand_is_refused():
    """A root splits into at least tree_children clusters: a per-tree cap below that is refused by name; the
    defaults (100 trees, 100 clusters per tree) and the toy's are accepted."""
    with pytest.raises(ConfigError,
                       match=r"strategy.max_clusters=15 is below strategy.tree_children=16: .*could expand"):
        DynnibalConfig(name="dynnibal", max_clusters=15)
    assert DynnibalConfig(name="dynnibal").max_clusters == DynnibalConfig(name="dynnibal").trees == 100
    DynnibalConfig(name="dynnibal", trees=4, max_clusters=16)


def test_algorithm_1_trains_and_resumes_bitwise(recipe_toy_dir, tmp_path):
    """Dynnibal in Algorithm 1 from step 0 (no warm start, no full refresh): metrics.json carries its memory and
    re-encoding counts; 3 steps + resume to 6 (its cache, forest and generator restored from the checkpoint) equals 6
    steps in one go."""
    extra = {"train.warmup_steps": 4}
    whole = train(recipe_toy_dir, tmp_path / "whole", **{"train.save_every": 3, **extra})
    written = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    summary = written["strategy_summary"]
    refreshes = STEPS // REFRESH
    assert written["reembedded_passages"] == summary["reencoded"] == refreshes * (LANDMARKS + NYSTROM_SAMPLES)
    assert summary["refreshes"] == refreshes and summary["trees"] == 2 and summary["low_dim"] == LANDMARKS
    dim, rows = 32, 300  # retriever.tiny.d_model of the test config; the toy corpus
    assert summary["device_memory_pct"] == pytest.approx(100 * (3 * LANDMARKS + NYSTROM_SAMPLES) * dim / (rows * dim))
    assert summary["host_memory_pct"] == pytest.approx(100 * LANDMARKS / dim)
    train(recipe_toy_dir, tmp_path / "split", steps=3, **extra)
    resumed = train(recipe_toy_dir, tmp_path / "split", **{"train.resume": "true", **extra})
    assert resumed["recall"] == whole["recall"] and resumed["strategy_summary"] == whole["strategy_summary"]
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "split")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_refresh_every_zero_never_reencodes(recipe_toy_dir, tmp_path):
    """Seed 000's "Dynnibal +0": with refresh_every 0 (and no warm start or full refresh) nothing is re-encoded, and
    the run is, bitwise, the one whose first refresh would come after its last step."""
    never = train(recipe_toy_dir, tmp_path / "zero", **{"strategy.refresh_every": 0})
    late = train(recipe_toy_dir, tmp_path / "late", **{"strategy.refresh_every": STEPS + 1})
    assert never["reembedded_passages"] == 0 and never["strategy_summary"]["refreshes"] == 0
    assert never["strategy_log"]["dynnibal/sampled"] == [1] * STEPS
    assert results(never) == results(late)
    a, b = weights(tmp_path / "zero"), weights(tmp_path / "late")
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    refreshed = train(recipe_toy_dir, tmp_path / "refreshed")  # the test config refreshes every REFRESH steps
    assert refreshed["reembedded_passages"] > 0  # so the config above really differs only by the refreshes


def train(toy_dir, out, steps=STEPS, **extra):
    return train_retriever(config(toy_dir, out, "dynnibal", steps=steps, **extra))


# The paper's schedule in miniature: uniform negatives for steps 1-3, then every target encoded (Alg. 6) after
# step 3, a Nyström refresh after step 4 (w = REFRESH = 2; none after step 2, still in the warm start), every target
# encoded again after step 5 (the full refresh), a Nyström refresh after step 6. Checkpoints after steps 2 and 4.
SCHEDULE = {"strategy.warm_start_steps": 3, "strategy.full_refresh_step": 5, "train.save_every": 2,
            "train.warmup_steps": 4}
PER_REFRESH = LANDMARKS + NYSTROM_SAMPLES
REENCODED = [0, 0, PASSAGES, PASSAGES + PER_REFRESH, 2 * PASSAGES + PER_REFRESH, 2 * PASSAGES + 2 * PER_REFRESH]


@pytest.fixture(scope="module")
def scheduled(recipe_toy_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("scheduled") / "run"
    return out, train(recipe_toy_dir, out, **SCHEDULE)


def test_the_schedule_fires_at_the_configured_steps(scheduled):
    """The strategy log per step against the hand count above: which steps sampled, the targets encoded so far;
    FindClustering expanded (clusters per question beyond the 2 roots, depth > 0) once Dynnibal runs."""
    _, metrics = scheduled
    log = metrics["strategy_log"]
    assert log["step"] == [1, 2, 3, 4, 5, 6]
    assert log["dynnibal/sampled"] == [0, 0, 0, 1, 1, 1]
    assert log["dynnibal/reencoded"] == REENCODED
    clusters = log["dynnibal/clusters_per_query"]
    assert all(c > 2 for c in clusters[3:]) and clusters[:3] == [0] * 3
    assert all(d > 0 for d in log["dynnibal/frontier_depth"][3:])
    summary = metrics["strategy_summary"]
    assert metrics["reembedded_passages"] == summary["reencoded"] == REENCODED[-1]
    assert summary["full_encodings"] == 2 and summary["refreshes"] == 2
    assert summary["sampled_questions"] == 3 * 4  # steps 4-6, batch 4
    assert summary["clusters_per_query"] == pytest.approx(np.mean(log["dynnibal/clusters_per_query"][3:]))


@pytest.mark.slow
def test_killed_across_the_warm_start_and_the_full_refresh_resumes_bitwise(recipe_toy_dir, tmp_path, scheduled):
    """SIGKILL after step 4 (last checkpoint: step 2, inside the warm start), resume and SIGKILL after step 6 (last
    checkpoint: step 4, before the full refresh), resume to the end: the straight run's metrics and weights,
    bitwise. The warm start is the uniform strategy: the step-2 checkpoint holds a 2-step uniform run's weights."""
    out = tmp_path / "run"
    args = [sys.executable, FAULTY, "--config", CONFIG]
    proc = run_script([*args, *overrides(recipe_toy_dir, out, "dynnibal", **SCHEDULE)], "kill:step:4")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000002"]
    uniform = train_retriever(config(recipe_toy_dir, tmp_path / "uniform", "uniform", steps=2,
                                     **{"train.warmup_steps": 4}))
    assert uniform["steps"] == 2
    a = load_file(str(out / "checkpoints" / "step-00000002" / "model.safetensors"))
    b = load_file(str(tmp_path / "uniform" / "checkpoints" / "step-00000002" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)

    proc = run_script([*args, *overrides(recipe_toy_dir, out, "dynnibal", **SCHEDULE, **{"train.resume": "true"})],
                      "kill:step:4")  # the 4th step of this process: step 6
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000004"]
    resumed = train(recipe_toy_dir, out, **SCHEDULE, **{"train.resume": "true"})
    assert results(resumed) == results(scheduled[1])
    a, b = weights(scheduled[0]), weights(out)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key

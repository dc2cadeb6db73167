"""SG-tree build cost (rag_train/buffer/sg_tree.py): one forest over N random unit vectors of dimension d, float32,
in host memory; prints build seconds, nodes, resident memory and the tree's own bytes, plus one FindClustering +
MH sampling round and one measured update after a small move (docs/dynnibal.md reports the figures).

    python scripts/bench_sg_tree.py --rows 100000 1000000 --dim 64 --trees 1
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rag_lab.bench.machine import cpu_name, peak_rss_bytes, rss_kib
from rag_train.buffer.sg_tree import build_forest, find_clustering, metropolis_hastings


def run(rows: int, dim: int, trees: int, base: float, children: int, leaf: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    points = rng.standard_normal((rows, dim), dtype=np.float32)
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    before = rss_kib()
    started = time.perf_counter()
    forest = build_forest(points, trees, rng, base, children, leaf)
    build = time.perf_counter() - started
    tree_bytes = sum(sum(a.nbytes for a in tree.arrays().values()) for tree in forest)
    query = points[0].astype(np.float64)
    started = time.perf_counter()
    clustering = find_clustering(forest, points, query, -14, 100)
    metropolis_hastings(clustering, points, query, 20.0, 64, 2, rng)
    sample = time.perf_counter() - started
    moved = points + 1e-3 * rng.standard_normal(points.shape, dtype=np.float32) / np.sqrt(dim)
    started = time.perf_counter()
    updated = [tree.update(moved, None, children, leaf) for tree in forest]
    update = time.perf_counter() - started
    return {"rows": rows, "dim": dim, "trees": trees, "build_s": build, "nodes": sum(len(t.centre) for t in forest),
            "depth": max(len(t.depth_groups()) for t in forest), "tree_mib": tree_bytes / 2**20,
            "points_mib": points.nbytes / 2**20, "rss_growth_mib": (rss_kib() - before) / 1024,
            "peak_rss_mib": peak_rss_bytes() / 2**20, "sample_s": sample, "update_s": update,
            "rebuilt_fraction": sum(t.rebuilt_points for t in updated) / rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--trees", type=int, default=1)
    parser.add_argument("--base", type=float, default=1.05)
    parser.add_argument("--children", type=int, default=16)
    parser.add_argument("--leaf", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"machine: {cpu_name()}")
    print("| rows | dim | trees | build s | nodes | depth | tree MiB | points MiB | peak RSS MiB | FindClustering+MH s "
          "| update s | rebuilt |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        r = run(rows, args.dim, args.trees, args.base, args.children, args.leaf, args.seed)
        print(f"| {r['rows']:,} | {r['dim']} | {r['trees']} | {r['build_s']:.1f} | {r['nodes']:,} | {r['depth']} "
              f"| {r['tree_mib']:.0f} | {r['points_mib']:.0f} | {r['peak_rss_mib']:.0f} | {r['sample_s']:.3f} "
              f"| {r['update_s']:.1f} | {100 * r['rebuilt_fraction']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()

"""Run Algorithm 1 once per strategy (same config, steps and seeds) and write a markdown comparison table.

    python scripts/compare_strategies.py --out docs/retriever_strategies.md \
        --strategies in_batch uniform stale corrector exhaustive snm negative_cache --seeds 0 1 [key=value ...]

Each run is its own process (`accelerate launch`) with its own run directory under --runs; a finished
run (metrics.json present) is reused, so an interrupted comparison continues where it stopped.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from rag_train.experiments import cell, run_once

ROOT = Path(__file__).resolve().parent.parent


def run_one(config: str, strategy: str, seed: int, runs: Path, overrides: list[str], processes: int) -> dict:
    return run_once(ROOT / "scripts" / "train_retriever.py", config, runs / f"{strategy}-seed{seed}",
                    [f"strategy.name={strategy}", f"train.seed={seed}", *overrides], processes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "toy" / "retriever.yaml"))
    parser.add_argument("--strategies", nargs="+", default=["in_batch", "uniform", "stale", "corrector", "exhaustive", "snm", "negative_cache"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--runs", default="runs/compare")
    parser.add_argument("--out", default=None, help="markdown file for the table (printed either way)")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    started = time.time()
    rows = []
    for strategy in args.strategies:
        results = [run_one(args.config, strategy, seed, Path(args.runs), args.overrides, args.processes) for seed in args.seeds]
        ks = sorted(results[0]["recall"], key=int)
        rows.append((strategy, ks, results))
    ks = rows[0][1]
    lines = ["| strategy | re-embedded | " + " | ".join(f"R@{k}" for k in ks) + " | MRR@10 | wall s |",
             "|---|---|" + "---|" * (len(ks) + 2)]
    for strategy, _, results in rows:
        recalls = " | ".join(cell([r["recall"][k] for r in results]) for k in ks)
        lines.append(f"| {strategy} | {results[0]['reembedded_passages']} | {recalls} | "
                     f"{cell([r['mrr@10'] for r in results])} | {statistics.mean(r['wall_seconds'] for r in results):.0f} |")
    table = "\n".join(lines)
    print(table)
    print(f"\n{len(args.strategies)} strategies x {len(args.seeds)} seeds in {time.time() - started:.0f} s", file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()

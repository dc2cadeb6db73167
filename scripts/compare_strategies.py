"""Run Algorithm 1 once per strategy (same config, steps and seeds) and write a markdown comparison table
(`rag_train.experiments.compare_strategies`).

    python scripts/compare_strategies.py --out docs/retriever_strategies.md \
        --strategies in_batch uniform stale corrector exhaustive snm negative_cache --seeds 0 1 [key=value ...]

Each run is its own process (`accelerate launch`) with its own run directory under --runs; a finished
run (metrics.json present) is reused, so an interrupted comparison continues where it stopped.
"""

import argparse
import sys
import time
from pathlib import Path

from rag_train.experiments import ROOT, compare_strategies

if __name__ == "__main__":
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
    table = compare_strategies(args.config, args.strategies, args.seeds, Path(args.runs), args.overrides, args.processes)
    print(table)
    print(f"\n{len(args.strategies)} strategies x {len(args.seeds)} seeds in {time.time() - started:.0f} s", file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")

"""Seed 002's Table 1 on the toy world: small-batch in-batch vs GradAccum vs GradCache vs ContAccum at the same
global batch N_total = N_local x K and the same number of steps, ContAccum's passage-only ablation, and in-batch at N_total (what a card that fits
it would run), over several seeds; recall@k, steps/s and peak memory in a markdown table.

    python scripts/compare_batching.py --local 4 --micro 4 --bank 64 --seeds 0 1 2 \
        --out docs/large_batches_table.md [key=value ...]

Each run is its own process with its own folder under --runs; a finished run (metrics.json) is reused.
"""

import argparse
import sys
import time
from pathlib import Path

from rag_train.experiments import batching_table, run_once

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "toy" / "retriever.yaml"))
    parser.add_argument("--local", type=int, default=4, help="N_local: the batch that fits")
    parser.add_argument("--micro", type=int, default=4, help="K micro-batches: N_total = local x micro")
    parser.add_argument("--bank", type=int, default=64, help="ContAccum bank size M")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--runs", default="runs/large_batches")
    parser.add_argument("--out", default=None, help="markdown file for the table (printed either way)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    n, k, total = args.local, args.micro, args.local * args.micro
    setups = {  # label -> overrides, in Table 1's order
        f"in-batch {n} (what fits)": [f"train.batch_size={n}"],
        f"GradAccum {n}x{k}": [f"train.batch_size={total}", "batching.name=grad_accum", f"batching.micro_batches={k}"],
        f"GradCache {n}x{k}": [f"train.batch_size={total}", "batching.name=grad_cache", f"batching.micro_batches={k}"],
        f"ContAccum {n}x{k}, M={args.bank}": [f"train.batch_size={total}", "batching.name=cont_accum",
                                              f"batching.micro_batches={k}", f"batching.bank_size={args.bank}"],
        f"ContAccum {n}x{k}, passage-only bank M={args.bank} (w/o M_q)": [
            f"train.batch_size={total}", "batching.name=cont_accum", f"batching.micro_batches={k}",
            f"batching.bank_size={args.bank}", "batching.bank_queries=false"],
        f"in-batch {total} (a card that fits it)": [f"train.batch_size={total}"],
    }
    started, results = time.time(), {}
    for label, extra in setups.items():
        slug = "".join(c for c in label.replace(" ", "_") if c.isalnum() or c in "_-")
        results[label] = [run_once(ROOT / "scripts" / "train_retriever.py", args.config,
                                   Path(args.runs) / f"{slug}-seed{seed}",
                                   [*args.overrides, *extra, f"train.seed={seed}"], threads=1)
                          for seed in args.seeds]
    table = batching_table(results)
    print(table)
    print(f"\n{len(setups)} setups x {len(args.seeds)} seeds in {time.time() - started:.0f} s", file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()

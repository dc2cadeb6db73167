"""Seed 002's Table 1 on the toy world: small-batch in-batch vs GradAccum vs GradCache vs ContAccum at the same
global batch N_total = N_local x K and the same number of steps, ContAccum's passage-only ablation, and in-batch at N_total (what a card that fits
it would run), over several seeds; recall@k, steps/s and peak memory in a markdown table.

    python scripts/compare_batching.py --local 4 --micro 4 --bank 64 --seeds 0 1 2 \
        --out docs/large_batches_table.md [key=value ...]

Each run is its own process with its own folder under --runs; a finished run (metrics.json) is reused.
"""

from rag_train.cli import exit_on_fault
from rag_train.experiments import compare_batching_main

if __name__ == "__main__":
    with exit_on_fault():
        compare_batching_main()

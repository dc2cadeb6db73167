"""Run Algorithm 1 once per strategy (same config, steps and seeds) and write a markdown comparison table
(`rag_lab.experiments.compare_strategies`).

    python scripts/compare_strategies.py --out docs/retriever_strategies.md \
        --strategies in_batch uniform stale corrector exhaustive snm negative_cache --seeds 0 1 [key=value ...]

Each run is its own process (`accelerate launch`) with its own run directory under --runs; a finished
run (metrics.json present) is reused, so an interrupted comparison continues where it stopped.
"""

from rag_lab.experiments import compare_strategies_main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        compare_strategies_main()

"""Run Algorithm 1 once per strategy (same config, steps and seeds) and write a markdown comparison table
(`rag_lab.experiments.compare_strategies`).

    python scripts/compare_strategies.py --out docs/retriever_strategies.md \
        --strategies in_batch uniform stale corrector exhaustive snm negative_cache --seeds 0 1 [key=value ...]

Each run is its own process (`accelerate launch`) with its own run directory under --runs; a finished
run (metrics.json present) is reused, so an interrupted comparison continues where it stopped.

On an x86-64 host with AVX2 its runs use ATen's AVX2 kernels, as the committed evidence did, unless ATEN_CPU_CAPABILITY
is set (rag_lab/reproduction/kernels.py).
"""

import os

from rag_lab.reproduction.kernels import pin_cpu_kernels

pin_cpu_kernels(os.environ)  # before torch loads: the evidence's AVX2 kernels (rag_lab/reproduction/kernels.py)

from rag_lab.experiments import compare_strategies_main  # noqa: E402
from rag_train.cli import exit_on_fault  # noqa: E402

if __name__ == "__main__":
    with exit_on_fault():
        compare_strategies_main()

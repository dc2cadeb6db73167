"""Reproduce seed 000's comparisons on the toy world end to end and write the report (docs/generated/reproduction.md;
`--help` lists every option and the sections, one module each in rag_lab/reproduction/, with their cost):

    nice -n 10 python scripts/reproduce.py                      # every section, default budgets and seeds
    python scripts/reproduce.py --only table1 ablation --seeds 0 1 2
    python scripts/reproduce.py --quick                         # tiny budgets, small world: a smoke test
    python scripts/reproduce.py --report-only                   # rewrite the report from finished runs
"""

import os

from rag_lab.reproduction.kernels import pin_cpu_kernels

pin_cpu_kernels(os.environ)  # before torch loads: the evidence's AVX2 kernels (rag_lab/reproduction/kernels.py)

from rag_lab.reproduction.command import main  # noqa: E402
from rag_train.cli import exit_on_fault  # noqa: E402

if __name__ == "__main__":
    with exit_on_fault():
        main()

"""Synthetic corrector experiment (seed 000, Section 5.3): the grid, its table and plots
(rag_lab/analysis/synthetic_report.py; docs/synthetic_corrector.md).

    python scripts/synthetic_corrector.py [--quick] [--seeds 0 1 2] [--out-dir docs/generated/figures/synthetic]
"""

from rag_lab.analysis.synthetic_report import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()

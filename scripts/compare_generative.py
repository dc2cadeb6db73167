"""Generative retrieval runs against dual-encoder runs on the same dev questions, at the title level:
`python scripts/compare_generative.py --generative RUN [RUN ...] --dense RUN [RUN ...] [--k 1 5 10]`
(runs of scripts/train_generative.py and scripts/train_retriever.py; one markdown table, mean ± sd over runs)."""

from rag_lab.analysis.generative_compare import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()

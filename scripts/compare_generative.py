"""Generative retrieval runs against dual-encoder runs on the same dev questions, at the title level:
`python scripts/compare_generative.py --generative RUN [RUN ...] --dense RUN [RUN ...] [--k 1 5 10]`
(runs of scripts/train_generative.py and scripts/train_retriever.py; one markdown table, mean ± sd over runs)."""

import argparse

from rag_train.analysis.generative_compare import comparison_table

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--generative", nargs="*", default=[], help="train_generative.py run directories")
    parser.add_argument("--dense", nargs="*", default=[], help="train_retriever.py run directories")
    parser.add_argument("--k", nargs="+", type=int, default=[1, 5, 10], help="recall@k cut-offs")
    args = parser.parse_args()
    print(comparison_table(args.generative, args.dense, args.k))

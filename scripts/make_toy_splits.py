"""Generative-retrieval splits of a described toy world (titles never in the question): `python
scripts/make_toy_splits.py --world DIR --out DIR [--dev-questions 300]` (rag_train/data/toy_splits.py)."""

from rag_train.cli import exit_on_fault
from rag_train.data.toy_splits import main

if __name__ == "__main__":
    with exit_on_fault():
        main()

"""Evaluate a finished RLM run on QA files (rag_train/train/evaluate_run.py):

    python scripts/evaluate.py --run runs/toy-rlm --data data/toy/nq-dev.jsonl data/toy/tqa-dev.jsonl
"""

from rag_train.cli import exit_on_fault
from rag_train.train.evaluate_run import main

if __name__ == "__main__":
    with exit_on_fault():
        main()

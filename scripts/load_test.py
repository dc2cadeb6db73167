"""Bounded load test of a running `rag-train serve` (rag_lab/bench/load_test.py; docs/serving.md).

    python scripts/load_test.py --url http://127.0.0.1:8000 --clients 16 --requests 2000 --k 10 --timeout 120
"""

import sys

from rag_lab.bench.load_test import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        sys.exit(main())

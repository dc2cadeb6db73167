"""SG-tree build benchmark (rag_lab/bench/sg_tree.py; docs/dynnibal.md).

    python scripts/bench_sg_tree.py --rows 100000 1000000 --dim 64
"""

from rag_lab.bench.sg_tree import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()

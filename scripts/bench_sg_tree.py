"""SG-tree build benchmark (rag_train/bench/sg_tree.py; docs/dynnibal.md).

    python scripts/bench_sg_tree.py --rows 100000 1000000 --dim 64
"""

from rag_train.bench.sg_tree import main

if __name__ == "__main__":
    main()

"""Buffer search benchmark (rag_lab/bench/search.py; docs/search_benchmark.md): CPU in-memory and memmapped
buffers, or `--device cuda` for a buffer held on the GPU.

    python scripts/bench_search.py --device cuda --rows 28000000 --dim 768 --hidden 8192 --batch 64 --k 32 \\
        --dtype bf16 --chunk 262144
"""

from rag_lab.bench.search import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()

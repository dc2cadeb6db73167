"""T5 attention kernels on CPU: eager (this project) against transformers' SDPA (rag_lab/bench/attention.py;
docs/rlm_toy_log.md).

    python scripts/bench_attention.py --threads 2
"""

from rag_lab.bench.attention import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()

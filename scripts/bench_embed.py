"""Passage embedding: `embed_rows` vs sentence-transformers' encode, passages/s and fraction of GEMM peak.

    python scripts/bench_embed.py                                   # CPU: tiny/small/base at 64/128/256 tokens
    python scripts/bench_embed.py --shapes '' --st-model /tmp/minilm/unpacked   # the real all-MiniLM-L6-v2
    python scripts/bench_embed.py --device cuda --workers 8 --scale 64          # one GPU

Logic and options: rag_lab/bench/embed.py (docs/embed_benchmark.md holds the figures).
"""

from rag_lab.bench.embed import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()

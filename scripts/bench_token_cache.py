"""Tokenising once: a toy retriever run that tokenises on every corpus pass against the same run reading the token
cache, tokeniser seconds and pass seconds side by side (both must end with the same metrics).

    python scripts/bench_token_cache.py                       # exhaustive refresh every 25 of 100 steps
    python scripts/bench_token_cache.py strategy.name=snm train.steps=100

Logic and options: rag_lab/bench/token_cache.py (docs/rlm_toy_log.md holds the figures).
"""

from rag_lab.bench.token_cache import main
from rag_train.cli import exit_on_fault

if __name__ == "__main__":
    with exit_on_fault():
        main()

"""Benchmarks: each module times the package's own code paths and prints ratios measured side by side in one
run; `scripts/bench_*.py` and `scripts/load_test.py` are their entry points."""

"""The toy-world reproduction of seed 000's comparisons behind scripts/reproduce.py: which runs to launch
(`plan`), the numbers and verdicts written to docs/generated/reproduction.md (`report`) and its figures (`plots`)."""

"""The seed paper's numbers the reproduction report sets beside its own (seed 000, notes/corrector-networks.md)."""

PAPER_TABLE1 = {  # NQ test recall@k, by the toy init that stands in for the paper's (random init has none)
    "pretrained": {"in_batch": {"1": 37.92, "5": 64.76, "10": 72.54, "20": 78.28, "100": 87.00},
                   "stale": {"1": 46.76, "5": 68.64, "10": 75.21, "20": 80.66, "100": 87.48},
                   "corrector": {"1": 50.61, "5": 71.00, "10": 77.73, "20": 82.66, "100": 88.39},
                   "exhaustive": {"1": 50.30, "5": 71.55, "10": 78.12, "20": 82.83, "100": 88.59}},
    "lm": {"in_batch": {"1": 23.40, "5": 47.50, "10": 56.39, "20": 65.34, "100": 77.97},
               "stale": {"1": 27.65, "5": 50.19, "10": 59.28, "20": 66.98, "100": 78.95},
               "corrector": {"1": 36.65, "5": 59.25, "10": 68.06, "20": 73.71, "100": 83.13},
               "exhaustive": {"1": 37.34, "5": 60.42, "10": 68.70, "20": 74.76, "100": 83.41}},
}
PAPER_INIT_LABELS = {"pretrained": "GTR-base init", "lm": "T5-base init"}  # the paper's init behind each Table 1 key
PAPER_TABLE3 = {  # exact match, GTR-base retriever
    "closed_book": {"nq": 25.4, "tqa": 26.1, "hotpotqa": 14.5},
    "frozen": {"nq": 48.4, "tqa": 55.1, "hotpotqa": 28.0},
    "corrector": {"nq": 52.3, "tqa": 66.4, "hotpotqa": 36.7},
    "exhaustive": {"nq": 52.4, "tqa": 66.5, "hotpotqa": 33.8},
}
PAPER_TABLE3_T5 = {  # exact match, T5-base retriever (the "No Retr." row reads no retriever: the same as GTR's)
    "closed_book": PAPER_TABLE3["closed_book"],
    "frozen": {"nq": 13.34, "tqa": 12.15, "hotpotqa": 13.37},
    "corrector": {"nq": 48.1, "tqa": 63.73, "hotpotqa": 21.97},
    "exhaustive": {"nq": 48.3, "tqa": 66.03, "hotpotqa": 25.45},
}
PAPER_TABLE2_STEPS_PER_SECOND = {2048: 1.83, 4096: 1.10, 8192: 0.83, "exhaustive": 0.43}

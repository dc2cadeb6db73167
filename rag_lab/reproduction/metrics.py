"""Reading an RLM run's metrics.json: exact match and its curve over training steps, for the report's tables and
its plots alike (recall and retrieval curves: rag_lab.experiments, which the comparison scripts share); and any run's
speed as a table cell."""

from __future__ import annotations

import statistics
from typing import Optional

from rag_lab.experiments import cell

DATASETS = ("nq", "tqa", "hotpotqa")
DATASET_LABELS = {"nq": "NQ-like", "tqa": "TQA-like", "hotpotqa": "HPQA-like"}


def mean_of(values: list[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def mean_em(m: dict) -> Optional[float]:
    return mean_of([m["em"].get(d) for d in DATASETS])


def em_curve(m: dict) -> list[tuple[int, float]]:
    """(step, EM averaged over the three datasets) from an RLM run's history plus its final evaluation."""
    points = [(e["step"], mean_of([e.get(d, {}).get("em") for d in DATASETS])) for e in m.get("history", [])]
    return [p for p in points if p[1] is not None] + [(m["steps"], mean_em(m))]


def hotpotqa_gold_recall(m: dict, at: int) -> Optional[float]:
    """The share of HotPotQA-like gold passages in the reader's top 4 at evaluation `at` of an RLM run's history."""
    history = [e for e in m.get("history", []) if "hotpotqa" in e]
    try:
        return history[at]["hotpotqa"].get("recall@4")
    except IndexError:  # fewer evaluations than `at` asks for
        return None


def rate(runs: list[dict]) -> str:
    """The runs' steps/s, mean ± sd over seeds."""
    return cell([m.get("steps_per_second") for m in runs], scale=1.0, digits=2)

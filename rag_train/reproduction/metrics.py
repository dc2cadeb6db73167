"""Reading a run's metrics.json: recall, exact match and their curves over training steps, for the report's
tables and its plots alike."""

from __future__ import annotations

import statistics
from typing import Optional

DATASETS = ("nq", "tqa", "hotpotqa")
DATASET_LABELS = {"nq": "NQ-like", "tqa": "TQA-like", "hotpotqa": "HPQA-like"}


def recall(m: dict, k: str = "1") -> Optional[float]:
    return m.get("recall", {}).get(k)


def mean_of(values: list[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def mean_em(m: dict) -> Optional[float]:
    return mean_of([m["em"].get(d) for d in DATASETS])


def retrieval_curve(m: dict, k: str = "1") -> list[tuple[int, float]]:
    """(step, recall@k) from a retriever run's history plus its final evaluation."""
    points = []
    for entry in m.get("history", []):
        data = next((v for v in entry.values() if isinstance(v, dict) and "recall" in v), None)
        if data is not None:
            points.append((entry["step"], data["recall"][k]))
    if recall(m, k) is not None:
        points.append((m["steps"], recall(m, k)))
    return points


def em_curve(m: dict) -> list[tuple[int, float]]:
    """(step, EM averaged over the three datasets) from an RLM run's history plus its final evaluation."""
    points = [(e["step"], mean_of([e.get(d, {}).get("em") for d in DATASETS])) for e in m.get("history", [])]
    return [p for p in points if p[1] is not None] + [(m["steps"], mean_em(m))]


def seed_mean_curve(runs: list[dict], curve) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every run evaluated at, with the mean, min and max over runs."""
    curves = [dict(curve(m)) for m in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    values = [[c[s] for c in curves] for s in steps]
    return steps, [statistics.mean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


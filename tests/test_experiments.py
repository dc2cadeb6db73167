"""The comparison scripts' summaries (rag_lab.experiments), checked against hand-computed values."""

from pathlib import Path

import pytest

from rag_lab.experiments import curve_table, gap_report, retrieval_curve
from rag_lab.reproduction.plan import RETRIEVER_CONFIG


def run(final, curve):
    """A retriever run's metrics.json with R@1 `final` after the `curve` of (step, R@1) evaluations."""
    history = [{"step": step, "described-retrieval": {"recall": {"1": r1}}} for step, r1 in curve]
    return {"recall": {"1": final}, "steps": 400, "history": history}


def test_curve_table_means_over_seeds_at_every_evaluated_step():
    rows = {"stale": [run(0.30, [(0, 0.0), (200, 0.20)]), run(0.40, [(0, 0.0), (200, 0.30)])],
            "exhaustive": [run(0.60, [(0, 0.0), (200, 0.50)])]}
    assert curve_table(rows, retrieval_curve).splitlines() == [
        "| step | stale | exhaustive |", "|---|---|---|", "| 0 | 0.0 | 0.0 |", "| 200 | 25.0 | 50.0 |",
        "| 400 | 35.0 | 60.0 |"]


def test_gap_report_of_the_means_and_per_seed_at_the_end_and_over_the_last_evaluations():
    rows = {"stale": [run(0.30, [(200, 0.10)]), run(0.40, [(200, 0.20)])],
            "corrector": [run(0.50, [(200, 0.30)]), run(0.40, [(200, 0.20)])],
            "exhaustive": [run(0.60, [(200, 0.50)]), run(0.40, [(200, 0.30)])]}
    # last step: means 35 / 45 / 50 -> (45 - 35) / (50 - 35) = 67%; seed 0: 20 / 30 = 67%, seed 1: no gap.
    # last 2 evaluations (steps 200 and 400): seed 0 stale 20, corrector 40, exhaustive 55 -> 20 / 35 = 57%;
    # seed 1 30 / 30 / 35 -> 0%; means 25 / 35 / 45 -> 50%
    assert gap_report(rows, tail=2).splitlines() == [
        "R@1 at the last step: stale 35.0, corrector 45.0, exhaustive 50.0; the corrector closes 67% of the gap of the "
        "means (per seed: 67%, n/a)",
        "R@1 over the last 2 evaluations: stale 25.0, corrector 35.0, exhaustive 45.0; the corrector closes 50% of the "
        "gap of the means (per seed: 57%, 0%)"]
    assert gap_report({"stale": rows["stale"], "exhaustive": rows["exhaustive"]}) is None


def recalls(r1, r5, r20, r100=None):
    """A run's final recall at 1 / 5 / 20 / 100 (R@100 left out: a run that did not evaluate it)."""
    at = {"1": r1, "5": r5, "20": r20, **({} if r100 is None else {"100": r100})}
    return {"recall": at, "steps": 400, "history": []}


def test_closure_at_every_k_of_the_means_per_seed_and_the_papers_by_hand():
    """(corrector - stale) / (exhaustive - stale) at each k. R@1: seeds 30 / 40 = 75%, 10 / 10 = 100%, means
    (65 - 45) / (70 - 45) = 80%. R@5: seed 0 below stale, -5 / 10 = -50%; seed 1 10 / 20 = 50%; means 2.5 / 15 = 17%.
    R@20: no gap anywhere (n/a, no division by zero). R@100: seed 0 5 / 5 = 100%, seed 1 no gap; means 2.5 / 2.5.
    SNM did not evaluate R@100 (`-`); its R@1 ends below stale: -10 / 40 = -25%, 0 / 10 = 0%, means -5 / 25 = -20%.
    The paper's row from its own table: 9 / 10, 0 / 10, 6 / 10, no gap."""
    from rag_lab.experiments import closure, closure_table

    rows = {"stale": [recalls(.40, .60, .80, .90), recalls(.50, .60, .80, .90)],
            "corrector": [recalls(.70, .55, .80, .95), recalls(.60, .70, .80, .90)],
            "exhaustive": [recalls(.80, .70, .80, .95), recalls(.60, .80, .80, .90)],
            "snm": [recalls(.30, .60, .80), recalls(.50, .60, .80)], "in_batch": []}
    paper = {"stale": {"1": 10, "5": 20, "20": 30, "100": 40}, "corrector": {"1": 19, "5": 20, "20": 36, "100": 40},
             "exhaustive": {"1": 20, "5": 30, "20": 40, "100": 40}}
    means, per_seed = closure(rows, "stale", "exhaustive", "corrector", "5")
    assert means == pytest.approx(2.5 / 15) and per_seed == pytest.approx([-0.5, 0.5])
    assert closure(rows, "stale", "exhaustive", "corrector", "20") == (None, [None, None])
    table = closure_table(rows, "stale", "exhaustive", ("corrector", "snm", "in_batch"),
                          {"corrector": "corrector", "snm": "SNM", "in_batch": "in-batch"}, {"T5-base init": paper})
    assert table.splitlines() == [
        "| stale → exhaustive closure | R@1 | R@5 | R@20 | R@100 |", "|---|---|---|---|---|",
        "| stale → exhaustive, means | 45.0 → 70.0 | 60.0 → 75.0 | 80.0 → 80.0 | 90.0 → 92.5 |",
        "| corrector: of the means | 80% | 17% | n/a | 100% |",
        "| corrector: per seed | 75%, 100% | -50%, 50% | n/a, n/a | 100%, n/a |",
        "| corrector: paper, T5-base init | 90% | 0% | 60% | n/a |",
        "| SNM: of the means | -20% | 0% | n/a | - |",
        "| SNM: per seed | -25%, 0% | 0%, 0% | n/a, n/a | - |"]
    assert closure_table({"stale": rows["stale"], "exhaustive": []}, "stale", "exhaustive", ("corrector",), {}, {}) \
        is None


def test_compare_strategies_reports_the_closure_at_every_k_beside_both_papers_inits(monkeypatch, tmp_path):
    """The comparison's table ends with the closure table: the same runs' closures as `closure` gives, and the
    paper's T5-base (93% at R@1: 9.00 / 9.69) and GTR-base (109%: 3.85 / 3.54) rows."""
    import rag_lab.experiments as experiments

    finals = {"stale": [.40, .50], "corrector": [.70, .60], "exhaustive": [.80, .60]}

    def run_once(script, config, out, overrides, processes=1):
        strategy, seed = Path(out).name.rsplit("-seed", 1)
        r1 = finals[strategy][int(seed)]
        return {**recalls(r1, r1, r1, r1), "reembedded_passages": 0, "mrr@10": r1, "wall_seconds": 1.0}

    monkeypatch.setattr(experiments, "run_once", run_once)
    table = experiments.compare_strategies(RETRIEVER_CONFIG, list(finals), [0, 1], tmp_path, [])
    assert "| corrector: of the means | 80% | 80% | 80% | 80% |" in table
    assert "| corrector: per seed | 75%, 100% | 75%, 100% | 75%, 100% | 75%, 100% |" in table
    assert "| corrector: paper, GTR-base init | 109% | 81% | 92% | 82% |" in table
    assert "| corrector: paper, T5-base init | 93% | 89% | 87% | 94% |" in table

"""The comparison scripts' summaries (rag_train.experiments), checked against hand-computed values."""

from rag_train.experiments import curve_table, gap_report, retrieval_curve


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

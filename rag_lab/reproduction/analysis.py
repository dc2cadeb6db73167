"""The report's analysis paragraphs, every figure in them computed from the runs they describe (a rerun with other
budgets or seeds rewrites them), so docs/generated/reproduction.md holds no number its runs did not produce."""

from __future__ import annotations

import statistics
from typing import Optional

from rag_lab.experiments import GAP, gap_closed, gap_means, recall, retrieval_curve, seed_mean_curve
from rag_lab.reproduction.metrics import DATASET_LABELS, DATASETS, em_curve, hotpotqa_gold_recall, mean_em, mean_of
from rag_lab.reproduction.paper import PAPER_TABLE1
from rag_lab.reproduction.plan import INIT_LABELS, INITS

ANALYSIS = "> **Analysis (computed from the runs above):**"


def percent(x: Optional[float]) -> str:
    return "n/a (no positive gap)" if x is None else f"{100 * x:.0f}%"


def paragraph(text: str) -> list[str]:
    """A computed paragraph and its blank line, or nothing when there were no runs to compute it from."""
    return [text, ""] if text else []


def table1_analysis(table1: dict[str, dict[str, list[dict]]], ablation: dict[int, list[dict]]) -> str:
    """Why Table 1's gaps differ from the paper's, with every figure computed from the runs it describes."""
    random, pretrained = table1.get("random", {}), table1.get("pretrained", {})
    parts = [f"{ANALYSIS} why the gaps differ from the paper's."]
    r20 = [v for v in (mean_of([recall(m, "20") for m in runs]) for runs in random.values()) if v is not None]
    if r20:
        parts.append(f"Every method from random init ends at {100 * min(r20):.1f}+ R@20, so mostly R@1 / MRR separate "
                     "methods here, where the paper's gaps persist to R@100 over 21M passages.")
    closures = {}
    for init, rows in (("random", random), ("pretrained", pretrained)):
        m = gap_means(rows)
        if m:
            closures[init] = (gap_closed(m["stale"], m["corrector"], m["exhaustive"]), m)
    if "random" in closures:
        closed, m = closures["random"]
        start = mean_of([dict(retrieval_curve(x)).get(0) for runs in random.values() for x in runs])
        steps = next(x["steps"] for runs in random.values() for x in runs)
        paper = gap_closed(*(PAPER_TABLE1["lm"][s]["1"] for s in ("stale", "corrector", "exhaustive")))
        parts.append(f"From random init the corrector closes {percent(closed)} of the stale → exhaustive R@1 gap "
                     f"(paper, T5 init: {percent(paper)}).")
        spread = [statistics.mean(100 * recall(x, "1") for x in runs) for runs in ablation.values() if runs]
        if len(spread) >= 2:
            gap = 100 * (m["exhaustive"] - m["corrector"])
            parts.append(f"The corrector size ablation below moves R@1 by {max(spread) - min(spread):.1f} points "
                         f"against a remaining corrector → exhaustive gap of {gap:.1f}"
                         + (": corrector capacity is not what limits it." if max(spread) - min(spread) < gap / 2
                            else ": corrector capacity matters here."))
        if start is not None:
            parts.append(f"The drift per step is large: the encoders go from R@1 {100 * start:.1f} at step 0 to "
                         f"{100 * m['exhaustive']:.1f} (exhaustive) in {steps} steps (the paper trains 40K), so the "
                         "stale buffer, embedded by the initial encoder, is far from every later one, and the "
                         "corrector learns only from each step's retrieved rows.")
    if "pretrained" in closures:
        closed, m = closures["pretrained"]
        gap = 100 * (m["exhaustive"] - m["stale"])
        parts.append(f"From the retrieval-pretrained init, where drift is small, the stale → exhaustive gap is "
                     f"{gap:.1f} points" + (f" and the corrector closes {percent(closed)} of it." if closed is not None
                                            else ": there is nothing for the corrector to close."))
    snm, exhaustive = random.get("snm"), random.get("exhaustive")
    if snm and exhaustive:
        parts.append(f"SNM re-embeds {snm[0]['reembedded_passages']:,} passages in a run (exhaustive "
                     f"{exhaustive[0]['reembedded_passages']:,}): on a toy corpus a refresh is a large share of it, "
                     "where the paper's refreshes touch a small fraction of 21M.")
    return " ".join(parts)


def _span(values: list[Optional[float]]) -> str:
    """`a` or `lo-hi` over seeds, as percentages."""
    values = [100 * v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}"


def _mean_curves(runs_by_strategy: dict[str, list[dict]], curve) -> dict[str, dict[int, float]]:
    return {s: dict(zip(*seed_mean_curve(runs, curve)[:2])) for s, runs in runs_by_strategy.items() if runs}


def _stays_above(high: dict[int, float], low: dict[int, float], steps: list[int]) -> Optional[int]:
    """The first evaluated step from which `high` is above `low` at every later evaluation (None: not at the end)."""
    return next((t for i, t in enumerate(steps) if all(high[u] > low[u] for u in steps[i:])), None)


def table1_curves_analysis(table1: dict[str, dict[str, list[dict]]]) -> str:
    """How the corrector's R@1 curve sits between stale and exhaustive, per init (seed means)."""
    parts = [f"{ANALYSIS} the curves' shape."]
    for init in INITS:
        curves = _mean_curves({s: table1.get(init, {}).get(s) or [] for s in GAP}, retrieval_curve)
        if len(curves) < len(GAP):
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves.values())) - {0})
        if not steps:
            continue
        corrector, stale, exhaustive = curves["corrector"], curves["stale"], curves["exhaustive"]
        behind = {t: 100 * (exhaustive[t] - corrector[t]) for t in steps}
        worst = max(steps, key=behind.get)
        above = _stays_above(corrector, stale, steps)
        parts.append(
            f"From {INIT_LABELS[init].split(' (')[0]}, the corrector is within "
            f"{max(abs(v) for v in behind.values()):.1f} R@1 points of exhaustive at every evaluation "
            f"(furthest behind at step {worst}: {behind[worst]:.1f}; at the end {behind[steps[-1]]:.1f})"
            + (f" and above stale from step {above} on." if above is not None else ", and not above stale at the end."))
    return " ".join(parts) if len(parts) > 1 else ""


def rlm_analysis(table3: dict[str, list[dict]]) -> str:
    """What the RLM runs show: EM by strategy, where the retrievers' passages went, what refreshing cost."""
    parts = [f"{ANALYSIS} what the RLM runs show."]
    ems = {s: mean_of([mean_em(m) for m in runs]) for s, runs in table3.items() if runs}
    if ems:
        parts.append("Mean EM over the three families: "
                     + ", ".join(f"{s} {100 * v:.1f}" for s, v in ems.items()) + ".")
    frozen = table3.get("frozen") or []
    trained = {s: table3.get(s) or [] for s in ("corrector", "exhaustive")}
    if frozen and all(trained.values()):
        for d in DATASETS[:2]:
            start = mean_of([m.get("answer_recall@4", {}).get(d) for m in frozen])
            if start is not None:
                parts.append(f"{DATASET_LABELS[d]} answer recall@4: {100 * start:.1f} with the warm-started retriever "
                             "(frozen), " + ", ".join(f"{_span([m.get('answer_recall@4', {}).get(d) for m in runs])} "
                                                     f"({s})" for s, runs in trained.items()) + " at the end.")
        start = mean_of([hotpotqa_gold_recall(m, -1) for m in frozen])
        if start is not None:
            rising = [s for s, runs in trained.items()
                      if (mean_of([hotpotqa_gold_recall(m, -1) for m in runs]) or 0.0)
                      > (mean_of([hotpotqa_gold_recall(m, -2) for m in runs]) or 0.0)]
            parts.append(f"{DATASET_LABELS['hotpotqa']} gold passages in the top 4: {100 * start:.1f}% warm-started, "
                         + ", ".join(f"{_span([hotpotqa_gold_recall(m, -1) for m in runs])}% ({s})"
                                     for s, runs in trained.items()) + " at the last evaluation"
                         + (f", still rising for {' and '.join(rising)}." if rising else "."))
        parts.append(f"{DATASET_LABELS['hotpotqa']} EM per seed: " + ", ".join(
            f"{s} {_span([m['em'].get('hotpotqa') for m in runs])}" for s, runs in table3.items() if runs) + ".")
        parts.append("Passages re-embedded after the buffer build: " + ", ".join(
            f"{s} {runs[0]['reembedded_passages']:,}" for s, runs in trained.items()) + ".")
    return " ".join(parts) if len(parts) > 1 else ""


def rlm_curves_analysis(table3: dict[str, list[dict]]) -> str:
    """The RLM's EM curves (seed means): where they start, how close corrector and exhaustive run, and the end gap to
    frozen with the HotPotQA-like family's part of it."""
    curves = _mean_curves({s: table3.get(s) or [] for s in ("frozen", "corrector", "exhaustive")}, em_curve)
    if len(curves) < 3:
        return ""
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    if len(steps) < 2:
        return ""
    frozen, corrector, exhaustive = curves["frozen"], curves["corrector"], curves["exhaustive"]
    apart = max(abs(corrector[t] - exhaustive[t]) for t in steps)
    above = _stays_above({t: min(corrector[t], exhaustive[t]) for t in steps}, frozen, steps)
    parts = [f"{ANALYSIS} the EM curves (mean over seeds).",
             f"All three start at {100 * statistics.mean(c[steps[0]] for c in curves.values()):.1f} mean EM (step "
             f"{steps[0]}); corrector and exhaustive run within {100 * apart:.1f} points of each other at every "
             "evaluation"
             + (f", both above frozen from step {above} on." if above is not None
                else ", not both above frozen at the end.")]
    hpqa = {s: mean_of([m["em"].get("hotpotqa") for m in table3[s]]) for s in curves}
    for s in ("corrector", "exhaustive"):
        gap = curves[s][steps[-1]] - frozen[steps[-1]]
        parts.append(f"At the end {s} is {100 * gap:+.1f} mean EM points from frozen, "
                     f"{100 * (hpqa[s] - hpqa['frozen']) / len(DATASETS):+.1f} of them from the "
                     f"{DATASET_LABELS['hotpotqa']} family.")
    return " ".join(parts)

"""The reproduction's `corrector_refresh` section: the drift-aware refresh (no paper does it) against exhaustive's
refresh intervals and SNM, as a curve of the stale -> exhaustive gap closed against the passages re-embedded.

It runs on the `corrector_regime` section's worlds, budget and paper feed (16 questions, top-8 + 8 uniform) and
reuses that section's rows as the curve's fixed points: stale (nothing re-embedded), exhaustive every 50 steps (the
gap's top), SNM and (d), the corrector this section adds the refresh to. Its own rows: exhaustive every 500 and
every 1,000 steps (the equal-cost controls: 10% and 5% of exhaustive's re-embedding), and (d) re-embedding the
buffer when cos(B[y], g(y)) on the step's rows, averaged over 10 steps, falls below 0.5 or 0.25
(`strategy.corrector.refresh_watch=cos_stale`; the default watched value, the subset overlap, does not move with the
drift from this init: docs/retriever_strategies.md). The issue's goal: >= 90% of the gap at <= 5% of exhaustive's
re-embedding."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from rag_lab.experiments import RECALL_AT, cell, closure, gap_share, recall_points
from rag_lab.reproduction import corrector_regime
from rag_lab.reproduction.plan import RETRIEVER_CONFIG, Plan, Run, build_lm, world_name
from rag_lab.reproduction.sections import Report, Section, register
from rag_lab.reproduction.verdict import compare
from rag_train.strategies import overrides_read_by


@dataclass(frozen=True)
class RefreshBudget:
    """The section's refresh keys, scaled to corrector_regime's steps so that every row refreshes at either size."""

    below: tuple[float, ...]  # the drift rows' thresholds on the windowed mean of cos(B[y], g(y))
    every: tuple[int, ...]  # exhaustive's sparser refresh intervals (steps): the equal-cost controls
    window: int  # steps the watched cosine is averaged over


# 2,000 steps, exhaustive every 50: every 500 / 1,000 re-embed 10% / 5% of what it does; the cosine's thresholds were
# read off the first world's drift (docs/corrector_regime.md)
FULL = RefreshBudget(below=(0.25, 0.5), every=(1000, 500), window=10)
# 8 steps, exhaustive every 2: every 8 / 4 re-embed 25% / 50%; the cosine falls from 1 to about 0.95 in 8 steps from
# the quick LM, so these thresholds are crossed (a quick run that never refreshed would test nothing of the policy)
QUICK = RefreshBudget(below=(0.98, 0.99), every=(8, 4), window=2)


@dataclass(frozen=True)
class Row:
    label: str
    strategy: str
    overrides: tuple[str, ...]  # after the paper feed's


def own_rows(budget: RefreshBudget) -> dict[str, Row]:
    """The section's rows by folder, in the order they run: a threshold, then an exhaustive interval, in turn."""
    rows = {}
    for below, every in zip(budget.below, budget.every):
        rows[f"corrector-below{round(100 * below)}"] = Row(
            f"(d) + refresh when cos(B[y], g(y)) < {below:g}", "corrector",
            (*corrector_regime.WIDE, *corrector_regime.MORE_UPDATES, "strategy.corrector.refresh_watch=cos_stale",
             f"strategy.corrector.refresh_window={budget.window}", f"strategy.corrector.refresh_below={below:g}"))
        rows[f"exhaustive-every{every}"] = Row(f"exhaustive, every {every:,} steps", "exhaustive",
                                               (f"strategy.refresh_every={every}",))
    return rows


REUSED = ("b-stale", "b-exhaustive", "b-snm", "d-corrector")  # the corrector_regime rows the curve shows
LOW, HIGH = "b-stale", "b-exhaustive"
GOAL_CLOSED, GOAL_COST = 0.9, 0.05


def rows_of(plan: Plan) -> dict[str, Row]:
    return own_rows(plan.budget_of(SECTION))


def run(plan: Plan, world: tuple[int, int], row: str, seed: int) -> Run:
    """One row on `world`: the corrector_regime section's world, LM and budget, the paper feed, its strategy and its
    own keys."""
    regime, own = plan.budget_of(corrector_regime.SECTION), rows_of(plan)[row]
    return Run("train_retriever.py", RETRIEVER_CONFIG,
               plan.runs / "corrector_refresh" / world_name(*world) / f"{row}-seed{seed}",
               ["train.tracker=null", *plan.described_world(world),
                f"retriever.model={plan.described_lm(world).folder()}",
                *overrides_read_by(own.strategy, regime.overrides), *corrector_regime.FEEDS["paper"][1],
                f"strategy.name={own.strategy}", *own.overrides, f"train.seed={seed}"])


def runs(plan: Plan) -> list[Run]:
    """Seed by seed over corrector_regime's worlds."""
    return [run(plan, w, r, seed) for seed in plan.seeds for w in plan.budget_of(corrector_regime.SECTION).worlds
            for r in rows_of(plan)]


def prepare(plan: Plan, threads) -> None:
    for world in plan.budget_of(corrector_regime.SECTION).worlds:
        build_lm(plan.described_lm(world), threads)


def rows(plan: Plan, world: tuple[int, int]) -> dict[str, list[dict]]:
    """The section's rows and the corrector_regime rows its curve reuses, from the seeds where all of them
    finished."""
    return plan.complete_seeds(
        {**{row: functools.partial(corrector_regime.run, plan, world, row) for row in REUSED},
         **{row: functools.partial(run, plan, world, row) for row in rows_of(plan)}})


def collect(plan: Plan) -> dict:
    """{"worlds": {world: {row: [metrics by seed]}}, the reused rows included; "own": the section's rows at the
    plan's budget}."""
    return {"worlds": {world_name(*w): rows(plan, w) for w in plan.budget_of(corrector_regime.SECTION).worlds},
            "own": rows_of(plan)}


def label(own: dict[str, Row], row: str) -> str:
    return own[row].label if row in own else corrector_regime.ROWS[row][0]


def reembedded(runs: list[dict]) -> float:
    return sum(m["reembedded_passages"] for m in runs) / len(runs)


def cost_share(rows: dict[str, list[dict]], row: str) -> Optional[float]:
    """The row's re-embedded passages (mean over seeds) as a share of exhaustive's (every 50 steps)."""
    full = [m["reembedded_passages"] for m in rows[HIGH]]
    if not full or not sum(full):
        return None
    return sum(m["reembedded_passages"] for m in rows[row]) / sum(full)


def curve_table(rows: dict[str, list[dict]], own: dict[str, Row]) -> str:
    """Every row ordered by passages re-embedded: the cost, R@k (mean ± sd over seeds) and the share of the
    stale -> exhaustive gap it closes at each k of RECALL_AT (of the means)."""
    ran = sorted((row for row in (*REUSED, *own) if rows.get(row)),
                 key=lambda row: sum(m["reembedded_passages"] for m in rows[row]))
    lines = ["| row | seeds | re-embedded (mean) | of exhaustive's | " + " | ".join(f"R@{k}" for k in RECALL_AT)
             + " | " + " | ".join(f"closed at R@{k}" for k in RECALL_AT) + " |",
             "|---|---|---|---|" + "---|" * (2 * len(RECALL_AT))]
    for row in ran:
        runs = rows[row]
        passages = reembedded(runs)
        share = cost_share(rows, row)
        recalls = " | ".join(cell([m["recall"][k] for m in runs]) for k in RECALL_AT)
        closed = " | ".join(gap_share(closure(rows, LOW, HIGH, row, k)[0]) for k in RECALL_AT)
        lines.append(f"| {label(own, row)} | {len(runs)} | {passages:,.0f} | "
                     f"{'-' if share is None else f'{100 * share:.1f}%'} | {recalls} | {closed} |")
    return "\n".join(lines)


def drift_rows(rows: dict[str, list[dict]], own: dict[str, Row]) -> list[str]:
    """The drift-aware rows that ran."""
    return [row for row, spec in own.items() if spec.strategy == "corrector" and rows.get(row)]


def refresh_lines(rows: dict[str, list[dict]], own: dict[str, Row]) -> list[str]:
    """When each drift-aware row re-embedded, per seed (`strategy_summary.refresh_steps`)."""
    lines = []
    for row in drift_rows(rows, own):
        per_seed = ["[" + ", ".join(map(str, m.get("strategy_summary", {}).get("refresh_steps", []))) + "]"
                    for m in rows[row]]
        lines.append(f"- {own[row].label}: re-embedded after steps {'; '.join(per_seed)} (per seed)")
    return lines


def verdict_lines(rows: dict[str, list[dict]], own: dict[str, Row]) -> list[str]:
    """Each drift-aware row against (d) without a refresh (does re-embedding help the corrector?) and against the
    exhaustive interval whose mean re-embedded passages are nearest its own (does it beat a fixed schedule at about
    its cost?): R@1 by the verdict rule, each p times the comparisons made (Holm's bound)."""
    fixed = [row for row, spec in own.items() if spec.strategy == "exhaustive" and rows.get(row)]
    pairs = []
    for row in drift_rows(rows, own):
        if rows.get("d-corrector"):
            pairs.append((row, "d-corrector"))
        if fixed:
            pairs.append((row, min(fixed, key=lambda other: abs(reembedded(rows[other]) - reembedded(rows[row])))))
    if not pairs:
        return []
    r1 = {row: recall_points(rows[row]) for pair in pairs for row in pair}
    return [f"R@1 by the verdict rule over the {len(pairs)} comparisons below (each p times {len(pairs)}: Holm's "
            "bound):"] + [
        f"- {label(own, a)} against {label(own, b)}: "
        f"{compare(label(own, a), r1[a], label(own, b), r1[b], m=len(pairs)).summary()}" for a, b in pairs]


def goal_line(rows: dict[str, list[dict]], own: dict[str, Row]) -> Optional[str]:
    """The goal as the issue states it, for each drift-aware row: >= 90% of the gap of the means at every k of
    RECALL_AT, with at most 5% of exhaustive's re-embedded passages. None unless the gap's ends and a row ran."""
    ran = drift_rows(rows, own)
    if not rows.get(LOW) or not rows.get(HIGH) or not ran:
        return None
    parts, reached = [], []
    for row in ran:
        shares = [closure(rows, LOW, HIGH, row, k)[0] for k in RECALL_AT]
        cost = cost_share(rows, row)
        ok = cost is not None and cost <= GOAL_COST and all(s is not None and s >= GOAL_CLOSED for s in shares)
        reached.append(ok)
        parts.append(f"{own[row].label}: {'-' if cost is None else f'{100 * cost:.1f}%'} of the re-embedding, "
                     "closed " + ", ".join(f"R@{k} {gap_share(s)}" for k, s in zip(RECALL_AT, shares)))
    word = "reached" if any(reached) else "not reached"
    return (f"The drift-aware refresh's goal (>= {GOAL_CLOSED:.0%} of the gap of the means at every k with <= "
            f"{GOAL_COST:.0%} of exhaustive's re-embedding): **{word}**. " + "; ".join(parts) + ".")


def corrector_refresh_section(results: Optional[dict]) -> list[str]:
    """reproduction.md's section from the collected runs (`collect`: this section's rows and the reused
    corrector_regime rows of the same seeds), or a line saying it did not run."""
    lines = ["## The drift-aware refresh against exhaustive's refresh intervals", "",
             "The corrector_regime section's paper feed and world; the stale -> exhaustive (every 50 steps) gap "
             "closed against the passages re-embedded (rag_lab/reproduction/corrector_refresh.py says which rows and "
             "why), over the seeds whose every row (its own and the reused ones) finished.", ""]
    worlds, own = (results or {}).get("worlds", {}), (results or {}).get("own", {})
    if not any(rows.get(row) for rows in worlds.values() for row in own):
        return lines + ["_(not run: `--only corrector_refresh`)_", ""]
    for world, rows in worlds.items():
        if any(rows.get(row) for row in own):
            lines += [f"### {world}", "", curve_table(rows, own), ""]
            for block in (refresh_lines(rows, own), verdict_lines(rows, own)):
                lines += block + ([""] if block else [])
            goal = goal_line(rows, own)
            lines += [goal, ""] if goal else []
    return lines


def render(report: Report) -> list[str]:
    return corrector_refresh_section(report.results["corrector_refresh"])


SECTION = register(Section(
    name="corrector_refresh", order=110,
    help="the drift-aware refresh (the corrector re-embedding the buffer when its drift crosses a threshold) against "
         "exhaustive every 500 and 1,000 steps, on corrector_regime's worlds and paper feed, whose stale, "
         "exhaustive, SNM and corrector rows it reuses: the gap closed against the passages re-embedded "
         "(rag_lab/reproduction/corrector_refresh.py). 36 runs of 10-40 min on one core, seed by seed.",
    full=FULL, quick=QUICK, runs=runs, render=render, collect=collect, prepare=prepare))

"""The reproduction's `large_batches` section: seed 002 (ContAccum) in its own regime, scripts/compare_batching.py's
setups with raw dot products at temperature 1 and in-batch negatives only, from the LM-pretrained init (its BERT):
its Table 1, the K x M sweep of its Figure 3, the gradient-norm ratio per step of its Figure 5 and the probe of that
ratio's cause, and the verdict on its claim (ContAccum above GradCache, GradAccum and the small in-batch batch at
the same N_total) by the rule. The runs are the section's own (each with its evidence); the tables are computed from
their metrics, the figure from `grad_ratio_curves`, which the evidence keeps (the runs' per-step series it drops)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from rag_lab.experiments import (
    batching_runs,
    batching_sweep_table,
    batching_table,
    grad_ratio_curves,
    grad_ratio_figure,
    plotted_setups,
    probe_table,
    probed_setups,
    recall_points,
)
from rag_lab.reproduction.plan import RETRIEVER_CONFIG, Plan, Run, build_lm
from rag_lab.reproduction.plots import figure_lines
from rag_lab.reproduction.sections import Report, Section, register
from rag_lab.reproduction.verdict import compare_variants, ordered

CURVES = "large_batches/grad_ratio_curves.json"  # Figure 5's points, under the evidence folder
FIGURE = "large_batches_grad_ratio.png"  # in the report's figures


@dataclass(frozen=True)
class LargeBatchesBudget:
    local: int  # N_local: the batch that fits
    micros: tuple[int, ...]  # K micro-batches: the first is Table 1's, the others sweep
    banks: tuple[int, ...]  # ContAccum bank sizes M: the first is Table 1's, the others sweep
    hard_negatives: int  # uniform negatives per question of Table 1's ContAccum with and without M_h
    overrides: tuple[str, ...]  # every run's


FULL = LargeBatchesBudget(local=4, micros=(4, 1, 2, 8), banks=(64, 16, 128), hard_negatives=1,
                          overrides=("train.steps=600", "train.eval_every=0", "train.log_every=10",
                                     "data.max_eval_examples=300"))
QUICK = LargeBatchesBudget(local=2, micros=(2,), banks=(4,), hard_negatives=1,
                           overrides=("train.steps=6", "train.eval_every=0", "train.log_every=1",
                                      "data.max_eval_examples=16"))


def setups(plan: Plan) -> dict[str, tuple[str, list[str]]]:
    budget = plan.budget_of(SECTION)
    return batching_runs(budget.local, list(budget.micros), list(budget.banks), budget.hard_negatives, probe=True)


def run(plan: Plan, label: str, seed: int) -> Run:
    """One setup (a label of `setups`) and seed, with seed 002's scoring from the world's LM."""
    slug, extra = setups(plan)[label]
    return Run("train_retriever.py", RETRIEVER_CONFIG, plan.runs / "large_batches" / f"{slug}-seed{seed}",
               [*plan.common, f"retriever.model={plan.lm().folder()}", "strategy.name=in_batch",
                "strategy.uniform_negatives=0", "retriever.normalize=false", "train.temperature=1.0",
                *plan.budget_of(SECTION).overrides, *extra, f"train.seed={seed}"])


def runs(plan: Plan) -> list[Run]:
    return [run(plan, label, seed) for label in setups(plan) for seed in plan.seeds]


def prepare(plan: Plan, threads) -> None:
    build_lm(plan.lm(), threads)


def collect(plan: Plan) -> dict:
    """{"results": {label: [metrics by seed]}, "curves": Figure 5's points (from the runs, or their evidence)}."""
    budget = plan.budget_of(SECTION)
    results = plan.paired({label: lambda seed, label=label: run(plan, label, seed) for label in setups(plan)})
    if plan.evidence is not None:
        path = plan.evidence / CURVES
        curves = json.loads(path.read_text()) if path.is_file() else {}
    else:
        curves = grad_ratio_curves(results, plotted_setups(list(results), budget.local, list(budget.micros)))
    return {"results": results, "curves": curves, "local": budget.local, "micros": list(budget.micros),
            "banks": list(budget.banks)}


def evidence_files(plan: Plan) -> dict:
    curves = collect(plan)["curves"]
    return {CURVES: curves} if curves else {}


def claim_line(results: dict[str, list[dict]], local: int, k: int, m: int) -> Optional[str]:
    """Seed 002's Table 1 claim: ContAccum (Table 1's N_local x K, bank M) above GradCache, GradAccum and in-batch
    N_local at the same N_total, R@1 by the rule (Holm over the three); None unless ContAccum and one of them ran."""
    contaccum = results.get(f"ContAccum {local}x{k}, M={m}") or []
    rivals = {label: results.get(label) or [] for label in
              (f"GradCache {local}x{k}", f"GradAccum {local}x{k}", f"in-batch {local} (what fits)")}
    rivals = {label: recall_points(runs) for label, runs in rivals.items() if runs}
    if not contaccum or not rivals:
        return None
    name = f"ContAccum {local}x{k}, M={m}"
    verdicts = compare_variants(name, recall_points(contaccum), rivals)
    above = [ordered(v, name) for v in verdicts.values()]
    word = "reproduced" if all(above) else "not reproduced" if any(a is False for a in above) else "undecided"
    return (f"Seed 002's claim ({name} above " + ", ".join(verdicts) + f" at N_total {local * k}), R@1 by the "
            f"verdict rule, Holm over the {len(verdicts)}: **{word}**. "
            + "; ".join(f"against {label}: {v.summary()}" for label, v in verdicts.items()) + ".")


def render(report: Report) -> list[str]:
    """Table 1, the sweep, the figure, the probe table and the claim's verdict from the collected runs, or a line
    saying the section did not run."""
    lines = ["## Seed 002 in its own regime: ContAccum, GradCache, GradAccum", "",
             "Raw dot products at temperature 1 and in-batch negatives, from the LM-pretrained init (the paper's "
             "BERT); the discussion and the other regimes: [large_batches.md](../large_batches.md).", ""]
    collected = report.results["large_batches"] or {}
    results = {label: runs for label, runs in collected.get("results", {}).items() if runs}
    if not results:
        return lines + ["_(not run: `--only large_batches`)_", ""]
    local, micros, banks = collected["local"], collected["micros"], collected["banks"]
    lines += [batching_table(results), ""]
    claim = claim_line(results, local, micros[0], banks[0])
    lines += [claim, ""] if claim else []
    if len(micros) > 1 or len(banks) > 1:
        lines += ["Figure 3's sweep: R@1 mean ± sd (R@20 mean) by K and bank size M:", "",
                  batching_sweep_table(results, local, micros, banks), ""]
    if collected["curves"]:
        grad_ratio_figure(collected["curves"], report.figures / FIGURE)
        lines += figure_lines(FIGURE, "gradient-norm ratio per step")
    probed = {label: results[label] for label in probed_setups(local, micros, banks) if label in results}
    if probed:
        lines += ["Figure 5's cause: Table 1's ContAccum runs probed at each step's weights "
                  "(`batching.probe_gradients`), each value the mean over steps 51 onwards (the ratio: the median), "
                  "mean ± sd over seeds:", "", probe_table(probed), ""]
    return lines


SECTION = register(Section(
    name="large_batches", order=60,
    help="seed 002 (ContAccum) in its own regime: scripts/compare_batching.py's setups with raw dot products at "
         "temperature 1 from the LM-pretrained init (the paper's BERT): its Table 1 with the claim's verdict, the "
         "K x M sweep of its Figure 3, the gradient-norm ratio per step of its Figure 5 and the probe of its cause.",
    full=FULL, quick=QUICK, runs=runs, render=render, collect=collect, prepare=prepare,
    evidence_files=evidence_files))

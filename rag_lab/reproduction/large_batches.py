"""The reproduction's `large_batches` section: seed 002 (ContAccum) in its own regime, scripts/compare_batching.py
with raw dot products at temperature 1 and in-batch negatives only, from the LM-pretrained init (its BERT); where
that script writes its tables and figure, and the report's section that embeds them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rag_lab.experiments import compare_batching_main
from rag_lab.reproduction.plan import Plan, Run, build_lm
from rag_lab.reproduction.sections import Report, Section, register


@dataclass(frozen=True)
class LargeBatchesBudget:
    arguments: tuple[str, ...]  # scripts/compare_batching.py's: N_local, the K and M sweeps
    overrides: tuple[str, ...]  # every run's


FULL = LargeBatchesBudget(
    arguments=("--local", "4", "--micro", "4", "1", "2", "8", "--bank", "64", "16", "128", "--hard-negatives", "1"),
    overrides=("train.steps=600", "train.eval_every=0", "train.log_every=10", "data.max_eval_examples=300"),
)
QUICK = LargeBatchesBudget(
    arguments=("--local", "2", "--micro", "2", "--bank", "4", "--hard-negatives", "1"),
    overrides=("train.steps=6", "train.eval_every=0", "train.log_every=1", "data.max_eval_examples=16"),
)


def outputs(out: Path) -> tuple[Path, Path, Path, Path]:
    """Table 1, the K x M sweep, the gradient-ratio figure and the probe table under the report folder `out`."""
    return (out / "large_batches_raw_lm_table.md", out / "large_batches_raw_lm_sweep.md",
            out / "figures" / "large_batches" / "grad_ratio_raw_lm.png", out / "large_batches_raw_lm_probe.md")


def arguments(plan: Plan) -> list[str]:
    """scripts/compare_batching.py's arguments: seed 002's Table 1, Figure 3 sweep and Figure 5 (with the probe of its
    cause) with its scoring (raw dot products, temperature 1, in-batch negatives only) from the LM-pretrained init
    (its BERT)."""
    budget = plan.budget_of(SECTION)
    table, sweep, figure, probe = outputs(plan.out)
    return [*budget.arguments, "--seeds", *map(str, plan.seeds),
            "--runs", str(plan.runs / "large_batches"), "--out", str(table), "--sweep-out", str(sweep),
            "--figure", str(figure), "--probe-out", str(probe),
            *plan.common, f"retriever.model={plan.lm().folder()}", "strategy.name=in_batch",
            "strategy.uniform_negatives=0", "retriever.normalize=false", "train.temperature=1.0", *budget.overrides]


def runs(plan: Plan) -> list[Run]:
    return []  # scripts/compare_batching.py launches its own, from prepare


def prepare(plan: Plan, threads) -> None:
    build_lm(plan.lm(), threads)
    compare_batching_main(arguments(plan))


def render(report: Report) -> list[str]:
    """The files the section wrote into the report's folder, or a line saying it did not run."""
    out = report.out
    lines = ["## Seed 002 in its own regime: ContAccum, GradCache, GradAccum", "",
             "Raw dot products at temperature 1 and in-batch negatives, from the LM-pretrained init (the paper's "
             "BERT); the discussion and the other regimes: [large_batches.md](../large_batches.md).", ""]
    table, sweep, figure, probe = outputs(out)
    if not table.is_file():
        return lines + ["_(not run: `--only large_batches`)_", ""]
    lines += [table.read_text().strip(), ""]
    if sweep.is_file():
        lines += ["Figure 3's sweep: R@1 mean ± sd (R@20 mean) by K and bank size M:", "",
                  sweep.read_text().strip(), ""]
    if figure.is_file():
        lines += [f"![gradient-norm ratio per step]({os.path.relpath(figure, out)})", ""]
    if probe.is_file():
        lines += ["Figure 5's cause: Table 1's ContAccum runs probed at each step's weights "
                  "(`batching.probe_gradients`), each value the mean over steps 51 onwards (the ratio: the median), "
                  "mean ± sd over seeds:", "", probe.read_text().strip(), ""]
    return lines


SECTION = register(Section(
    name="large_batches", order=60,
    help="seed 002 (ContAccum) in its own regime: scripts/compare_batching.py with raw dot products at temperature 1 "
         "from the LM-pretrained init (the paper's BERT): its Table 1, the K x M sweep of its Figure 3 and the "
         "gradient-norm ratio per step of its Figure 5 (<out>/large_batches_raw_lm_*.md).",
    full=FULL, quick=QUICK, runs=runs, render=render, prepare=prepare))

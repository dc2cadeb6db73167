"""The reproduction's `synthetic` section: seed 000's Section 5.3 grid, the corrector alone mapping stale vectors to
drifted ones (scripts/synthetic_corrector.py, whose results.json under the report's figures is reused when there)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rag_lab.analysis.synthetic import aggregate
from rag_lab.reproduction.plan import ROOT, Plan, Run
from rag_lab.reproduction.sections import Report, Section, register
from rag_train.io import read_json


@dataclass(frozen=True)
class SyntheticBudget:
    arguments: tuple[str, ...]  # scripts/synthetic_corrector.py's


FULL = SyntheticBudget(arguments=())
QUICK = SyntheticBudget(arguments=("--quick",))


def folder(out: Path) -> Path:
    return out / "figures" / "synthetic"


def runs(plan: Plan) -> list[Run]:
    return []  # one script of its own, run by prepare


def prepare(plan: Plan, threads) -> None:
    if (folder(plan.out) / "results.json").is_file():
        print(f"synthetic: reusing {folder(plan.out) / 'results.json'}", flush=True)
        return
    cmd = [sys.executable, str(ROOT / "scripts" / "synthetic_corrector.py"), "--out-dir", str(folder(plan.out)),
           *plan.budget_of(SECTION).arguments]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def collect(plan: Plan) -> Optional[dict]:
    results = folder(plan.out) / "results.json"
    return read_json(results) if results.is_file() else None


def synthetic_summary(results: dict) -> list[str]:
    agg = aggregate(results["runs"])
    fractions = sorted(results["fractions"])
    full = fractions[-1]
    tenth = 0.1 if 0.1 in fractions and full != 0.1 else None  # the paper: ~10% of targets is generally enough
    by_params = sorted({(v["params"], v["corrector"]) for v in agg.values()})
    smallest, largest = by_params[0][1], by_params[-1][1]
    lines = ["| drift scale | staleness KL | best corrector (all targets) | KL after | reduction | "
             + ("same corrector on 10% of targets | " if tenth else "")
             + f"KL after: {smallest} / {largest} |", "|" + "---|" * (6 + bool(tenth))]
    ratios = []
    for drift in sorted(results["drift_scales"]):
        rows = {v["corrector"]: v for (d, _, _, f), v in agg.items() if d == drift and f == full}
        best = min(rows.values(), key=lambda v: v["kl_after"])
        ratio = rows[smallest]["kl_after"] / rows[largest]["kl_after"]
        ratios.append(ratio)
        few = ""
        if tenth:
            at_tenth = next(v for (d, _, _, f), v in agg.items() if d == drift and f == tenth
                            and v["corrector"] == best["corrector"])
            few = f"{at_tenth['kl_after']:.4f} | "
        lines.append(f"| {drift:g} | {best['kl_stale']:.3f} | {best['corrector']} | {best['kl_after']:.4f} | "
                     f"{100 * (1 - best['kl_after'] / best['kl_stale']):.0f}% | {few}{ratio:.1f}x |")
    grows = all(a <= b for a, b in zip(ratios, ratios[1:]))
    lines += ["", f"{len(results['runs'])} corrector trainings ({len(results['correctors'])} correctors, "
              f"{len(results['drift_scales'])} drift levels, fractions {fractions}, seeds {results['seeds']}) in "
              f"{results['wall_seconds']:.0f} s. The advantage of the largest corrector ({largest}) over the smallest "
              f"({smallest}) {'grows' if grows else 'does not grow monotonically'} with the drift (paper: more "
              "parameters help more when the drift is larger)."]
    return lines


def render(report: Report) -> list[str]:
    lines = ["## Section 5.3: the synthetic experiment", "",
             "The corrector alone, trained to map stale vectors g'(y) to drifted ones g(y) (details and the full "
             "table: [synthetic_corrector.md](../synthetic_corrector.md)).", ""]
    results = report.results["synthetic"]
    if not results:
        return lines + ["_(not run: `--only synthetic`)_", ""]
    rel = os.path.relpath(folder(report.out), report.out)
    return lines + synthetic_summary(results) + [
        "", f"![KL after vs parameters]({rel}/kl_vs_params.png)", "",
        f"![KL after vs staleness]({rel}/kl_after_vs_staleness.png)", ""]


SECTION = register(Section(
    name="synthetic", order=50,
    help="the Section 5.3 grid (scripts/synthetic_corrector.py; an existing results.json is reused: about 5 min when "
         "it has to be rerun).",
    full=FULL, quick=QUICK, runs=runs, render=render, collect=collect, prepare=prepare))

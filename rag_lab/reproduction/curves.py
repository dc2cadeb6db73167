"""The reproduction's `curves` section: recall and EM over training steps for stale, corrector and exhaustive,
read from the `table1` and `table3` sections' runs (it plans those runs, so that it can run alone, and adds none)."""

from __future__ import annotations

from rag_lab.experiments import curve_table, retrieval_curve
from rag_lab.reproduction import table1, table3
from rag_lab.reproduction.analysis import paragraph, rlm_curves_analysis, table1_curves_analysis
from rag_lab.reproduction.metrics import em_curve
from rag_lab.reproduction.plan import INIT_LABELS, INITS, Plan, Run, build_lm
from rag_lab.reproduction.plots import figure_lines, plot_curves
from rag_lab.reproduction.sections import Report, Section, register
from rag_train.io import remove_temporaries_of

CURVES = ("stale", "corrector", "exhaustive")
RLM_CURVES = ("frozen", "corrector", "exhaustive")


def runs(plan: Plan) -> list[Run]:
    """Table 1's pretraining and rows of CURVES, Table 3's warm-start holder and rows of RLM_CURVES."""
    return ([table1.pretrain(plan)]
            + [table1.run(plan, i, s, seed) for i in INITS for s in CURVES for seed in plan.seeds]
            + [table3.run(plan, table3.TABLE3[0], plan.seeds[0])]
            + [table3.run(plan, s, seed) for seed in plan.seeds for s in RLM_CURVES])


def prepare(plan: Plan, threads) -> None:
    build_lm(plan.lm(), threads)


def render(report: Report) -> list[str]:
    """The curves' figure, their tables by init and the analysis of their shape, from the Table 1 and 3 results."""
    runs1, runs3 = report.results["table1"]["runs"], report.results["table3"]["runs"]
    figure = report.figures / "curves.png"
    remove_temporaries_of(figure)  # a killed report's
    plotted = plot_curves(runs1, runs3, figure, CURVES, RLM_CURVES)
    lines = [
        "## Training curves",
        "",
        "Mean over seeds (band: min-max) of R@1 during Algorithm 1 (the Table 1 runs, evaluated every "
        "`train.eval_every` steps from step 0) and of EM during Algorithm 2 (the Table 3 runs).",
        "",
        *figure_lines(plotted, "training curves"),
    ]
    for init in INITS:
        lines += [f"R@1 (%) over steps, {INIT_LABELS[init]}:", "",
                  curve_table({s: runs1.get(init, {}).get(s) or [] for s in CURVES}, retrieval_curve), ""]
    return lines + ["EM (%, mean of the three datasets) over steps, Algorithm 2:", "",
                    curve_table({s: runs3[s] for s in RLM_CURVES}, em_curve), "",
                    *paragraph(table1_curves_analysis(runs1)), *paragraph(rlm_curves_analysis(runs3))]


SECTION = register(Section(
    name="curves", order=40,
    help="recall and EM over training steps for stale, corrector and exhaustive (the table1 / table3 runs).",
    full=None, quick=None, runs=runs, render=render, prepare=prepare))

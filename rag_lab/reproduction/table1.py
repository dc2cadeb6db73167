"""The reproduction's `table1` section: seed 000's Table 1 in miniature, Algorithm 1 on the toy world from three
inits (random, which the paper never ran; the world's span-corruption toy T5 for its T5-base; a retriever first
trained in-batch on another toy world for its GTR-base), every strategy of the table, R@k against the paper's."""

from __future__ import annotations

from dataclasses import dataclass

from rag_lab.experiments import cell, recall
from rag_lab.reproduction.analysis import table1_analysis
from rag_lab.reproduction.comparison import table1_comparison
from rag_lab.reproduction.metrics import rate
from rag_lab.reproduction.paper import PAPER_TABLE1
from rag_lab.reproduction.plan import INIT_LABELS, INITS, RETRIEVER_CONFIG, Plan, Run, build_lm, init_model
from rag_lab.reproduction.plots import figure_lines, plot_table1
from rag_lab.reproduction.sections import Report, Section, register
from rag_train.io import remove_temporaries_of
from rag_train.strategies import overrides_read_by

TABLE1 = ("in_batch", "stale", "corrector", "exhaustive", "snm", "negative_cache", "dynnibal", "trainable_cache")


@dataclass(frozen=True)
class Table1Budget:
    retriever: tuple[str, ...]  # every run (the ablation's and the curves' too: they are these runs)
    pretrain: tuple[str, ...]  # the GTR stand-in's supervised pretraining on the other world


FULL = Table1Budget(
    retriever=("train.steps=300", "train.eval_every=50", "strategy.refresh_every=50"),
    pretrain=("strategy.name=in_batch", "train.steps=300", "train.batch_size=32", "train.eval_every=0"),
)
QUICK = Table1Budget(
    retriever=("train.steps=12", "train.eval_every=6", "strategy.refresh_every=6", "strategy.snm_targets=100",
               "strategy.cache_size=64", "strategy.cache_refresh=8"),
    pretrain=("strategy.name=in_batch", "train.steps=12", "train.eval_every=0"),
)


def pretrain(plan: Plan) -> Run:
    """The GTR stand-in: Algorithm 1 with in-batch negatives on a toy world with other entities (toy_seed=1)."""
    other = [f"data.toy_dir={plan.runs / 'toy-world-seed1'}", "data.toy_seed=1"]
    if plan.budget.toy_passages is not None:
        other.append(f"data.toy_passages={plan.budget.toy_passages}")
    return Run("train_retriever.py", RETRIEVER_CONFIG, plan.runs / "pretrain",
               ["train.tracker=null", *other, *plan.budget_of(SECTION).pretrain])


def run(plan: Plan, init: str, strategy: str, seed: int, extra: tuple[str, ...] = ()) -> Run:
    """One cell's run; `extra` overrides come last (the ablation's corrector size)."""
    model = init_model(init, plan.lm, lambda: pretrain(plan))
    budget = overrides_read_by(strategy, plan.budget_of(SECTION).retriever)
    return Run("train_retriever.py", RETRIEVER_CONFIG, plan.runs / "table1" / init / f"{strategy}-seed{seed}",
               [*plan.common, *budget, *model, f"strategy.name={strategy}", f"train.seed={seed}", *extra])


def runs(plan: Plan) -> list[Run]:
    """The pretraining first (the retrieval-pretrained init starts from it), then every init, strategy and seed."""
    return [pretrain(plan)] + [run(plan, i, s, seed) for i in INITS for s in TABLE1 for seed in plan.seeds]


def prepare(plan: Plan, threads) -> None:
    build_lm(plan.lm(), threads)


def collect(plan: Plan) -> dict:
    """{"pretrain": its metrics or None, "runs": {init: {strategy: [metrics by seed]}}}, each init's rows over the
    seeds they all finished (`Plan.paired`)."""
    return {"pretrain": plan.metrics_of(pretrain(plan)),
            "runs": {i: plan.paired({s: lambda seed, i=i, s=s: run(plan, i, s, seed) for s in TABLE1}) for i in INITS}}


def table1_markdown(rows: dict[str, list[dict]], init: str) -> str:
    present = {s: r for s, r in rows.items() if r}
    if not present:
        return "_no finished runs_"
    ks = sorted(next(iter(present.values()))[0]["recall"], key=int)
    paper = PAPER_TABLE1.get(init, {})
    lines = ["| strategy | seeds | re-embedded | " + " | ".join(f"R@{k}" for k in ks) + " | MRR@10 | steps/s | "
             "paper R@1 / R@20 |", "|---|---|---|" + "---|" * (len(ks) + 3)]
    for strategy, runs in present.items():
        recalls = " | ".join(cell([recall(m, k) for m in runs]) for k in ks)
        ref = paper.get(strategy)
        ref = f"{ref['1']:.1f} / {ref['20']:.1f}" if ref else "-"
        lines.append(f"| {strategy} | {len(runs)} | {runs[0]['reembedded_passages']} | {recalls} | "
                     f"{cell([m.get('mrr@10') for m in runs])} | {rate(runs)} | {ref} |")
    return "\n".join(lines)


def render(report: Report) -> list[str]:
    """The tables by init, their figure, the paper's claims against them and why the gaps differ (which reads the
    ablation's runs)."""
    found = report.results["table1"]
    table1, pre = found["runs"], found["pretrain"]
    figure = report.figures / "table1_recall.png"
    remove_temporaries_of(figure)  # a killed report's
    plotted = plot_table1(table1, figure)
    lines = [
        "## Table 1 in miniature: supervised retrieval (Algorithm 1)",
        "",
        "Toy world (retrieval-dev questions, gold passage recall@k over the corpus embedded by the final model). "
        "Three inits. The LM-pretrained init stands in for T5-base: a tiny T5 trained only with T5's span corruption "
        "on this world's passages (`scripts/pretrain_toy_lm.py`, configs/toy/lm.yaml; no questions, no labels), its "
        "encoder mean-pooled. The retrieval-pretrained init stands in for GTR-base: a tiny dual encoder first "
        "trained with Algorithm 1 (in-batch negatives) on a *different* toy world (`toy_seed=1`, other entities), so "
        "it knows the task's language but not this corpus — as GTR was trained on other data than NQ. Random init "
        "is a drift the paper never ran (recall starts near 0)."
        + (f" Pretraining: {pre['steps']} steps, {pre.get('wall_seconds', 0):.0f} s, R@1 on its own world "
           f"{100 * recall(pre, '1'):.1f}." if pre else ""),
        "",
    ]
    for init in INITS:
        lines += [f"### {INIT_LABELS[init]}", "", table1_markdown(table1.get(init, {}), init), ""]
    lines += figure_lines(plotted, "Table 1 recall")
    return lines + ["### Against the paper (computed)", "", *table1_comparison(table1, TABLE1), "",
                    table1_analysis(table1, report.results["ablation"]), ""]


SECTION = register(Section(
    name="table1", order=10,
    help="Algorithm 1 (paper Table 1): in-batch, stale, corrector, exhaustive, SNM, negative cache, Dynnibal, "
         "trainable cache, from three inits: random (no paper counterpart), LM-pretrained (the paper's T5: a tiny T5 "
         "trained by span corruption on the world's passages, scripts/pretrain_toy_lm.py) and retrieval-pretrained "
         "(its GTR: a tiny retriever first trained supervised, in-batch, on ANOTHER toy world, toy_seed=1, with "
         "other entities). A 300-step run takes 40-70 s on 2 CPU cores (one torch thread per run): with ablation and "
         "curves about 35 min with the default 3 seeds.",
    full=FULL, quick=QUICK, runs=runs, render=render, collect=collect, prepare=prepare,
    budget_note=lambda budget: f"Algorithm 1 `{' '.join(budget.retriever)}`"))

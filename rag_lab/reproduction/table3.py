"""The reproduction's `table3` section: seed 000's Table 3 in miniature, Algorithm 2 (the RLM) on the toy world:
closed book, frozen retriever, corrector and exhaustive from one shared warm start, and frozen / corrector /
exhaustive again from the paper's T5 retriever init (the world's toy T5, with the same reader), EM against the
paper's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rag_lab.experiments import cell
from rag_lab.reproduction.analysis import paragraph, rlm_analysis
from rag_lab.reproduction.comparison import table3_comparison
from rag_lab.reproduction.metrics import DATASET_LABELS, DATASETS, hotpotqa_gold_recall, mean_em, rate
from rag_lab.reproduction.paper import PAPER_TABLE3, PAPER_TABLE3_T5
from rag_lab.reproduction.plan import RLM_CONFIG, Plan, Run, build_lm
from rag_lab.reproduction.plots import figure_lines, plot_table3
from rag_lab.reproduction.sections import Report, Section, register
from rag_train.io import remove_temporaries_of
from rag_train.strategies import overrides_read_by

TABLE3 = ("closed_book", "frozen", "corrector", "exhaustive")
TABLE3_LM = ("frozen", "corrector", "exhaustive")  # from the LM init; closed book reads no retriever: TABLE3's


@dataclass(frozen=True)
class Table3Budget:
    rlm: tuple[str, ...]  # every run (the curves' too: they are these runs)


FULL = Table3Budget(rlm=("strategy.refresh_every=50", "train.eval_every=100"))
QUICK = Table3Budget(rlm=("train.steps=6", "train.eval_every=3", "strategy.refresh_every=3",
                          "warm_start.reader_steps=8", "warm_start.reader_copy_steps=4",
                          "warm_start.retriever_steps=6", "data.max_eval_examples=16"))


def holder(plan: Plan) -> Path:
    """The run whose warm-start stages every other Table 3 run reuses (it runs first)."""
    return plan.runs / "table3" / f"{TABLE3[0]}-seed{plan.seeds[0]}"


def run(plan: Plan, strategy: str, seed: int) -> Run:
    shared = [] if (strategy, seed) == (TABLE3[0], plan.seeds[0]) else [f"warm_start.from_run={holder(plan)}"]
    return Run("train_rlm.py", RLM_CONFIG, plan.runs / "table3" / f"{strategy}-seed{seed}",
               [*plan.common, *overrides_read_by(strategy, plan.budget_of(SECTION).rlm), f"strategy.name={strategy}",
                f"train.seed={seed}", *shared])


def run_lm(plan: Plan, strategy: str, seed: int) -> Run:
    """A run whose retriever starts from the world's span-corruption toy T5 (the paper's T5-base retriever) with no
    retrieval training, and whose reader is the GTR-like runs' warm-started one."""
    return Run("train_rlm.py", RLM_CONFIG, plan.runs / "table3-lm" / f"{strategy}-seed{seed}",
               [*plan.common, *overrides_read_by(strategy, plan.budget_of(SECTION).rlm),
                f"retriever.model={plan.lm().folder()}",
                "warm_start.retriever_steps=0",  # after the budget's: the later override wins
                f"strategy.name={strategy}", f"train.seed={seed}", f"warm_start.from_run={holder(plan)}"])


def runs(plan: Plan) -> list[Run]:
    """The holder first, then seed by seed, both inits."""
    return [r for seed in plan.seeds for r in [run(plan, s, seed) for s in TABLE3] + [run_lm(plan, s, seed)
                                                                                        for s in TABLE3_LM]]


def prepare(plan: Plan, threads) -> None:
    build_lm(plan.lm(), threads)


def collect(plan: Plan) -> dict:
    """{"runs": {strategy: [metrics by seed]}, "lm": the same from the LM init}, over the seeds every row of the
    init finished (`Plan.paired`)."""
    return {"runs": plan.paired({s: lambda seed, s=s: run(plan, s, seed) for s in TABLE3}),
            "lm": plan.paired({s: lambda seed, s=s: run_lm(plan, s, seed) for s in TABLE3_LM})}


def table3_markdown(rows: dict[str, list[dict]], paper_table: dict = PAPER_TABLE3) -> str:
    present = {s: r for s, r in rows.items() if r}
    if not present:
        return "_no finished runs_"
    head = " | ".join(f"{DATASET_LABELS[d]} EM" for d in DATASETS)
    paper = " | ".join(f"paper {d}" for d in ("NQ", "TQA", "HPQA"))
    lines = [f"| strategy | seeds | re-embedded | {head} | mean EM | steps/s | retriever trained from step | {paper} |",
             "|" + "---|" * 12]
    for strategy, runs in present.items():
        ems = " | ".join(cell([m["em"].get(d) for m in runs]) for d in DATASETS)
        ref = " | ".join(f"{paper_table[strategy][d]:.1f}" for d in DATASETS)
        gate = "-" if strategy in ("closed_book", "frozen") else ", ".join(
            "never" if m.get("retriever_trained_from_step") is None else str(m["retriever_trained_from_step"])
            for m in runs)
        lines.append(f"| {strategy} | {len(runs)} | {runs[0]['reembedded_passages']} | {ems} | "
                     f"{cell([mean_em(m) for m in runs])} | {rate(runs)} | {gate} | {ref} |")
    return "\n".join(lines)


def recall_markdown(rows: dict[str, list[dict]]) -> str:
    """Where the retriever's passages went: answer recall@4 (an answer string in the top 4) per dataset, and for
    HPQA-like the share of gold passages in the top 4, at step 0 and at the end."""
    present = {s: r for s, r in rows.items() if r and s != "closed_book"}
    if not present:
        return "_no finished runs_"

    head = " | ".join(f"{DATASET_LABELS[d]} answer R@4" for d in DATASETS)
    lines = [f"| strategy | seeds | {head} | HPQA-like gold passages in top 4: step 0 → end |", "|" + "---|" * 6]
    for strategy, runs in present.items():
        answers = " | ".join(cell([m.get("answer_recall@4", {}).get(d) for m in runs]) for d in DATASETS)
        lines.append(f"| {strategy} | {len(runs)} | {answers} | {cell([hotpotqa_gold_recall(m, 0) for m in runs])} → "
                     f"{cell([hotpotqa_gold_recall(m, -1) for m in runs])} |")
    return "\n".join(lines)


def lm_lines(table3: dict[str, list[dict]], table3_lm: dict[str, list[dict]]) -> list[str]:
    """Table 3 from the LM-pretrained retriever (the paper's T5-base rows) beside the GTR-like rows above."""
    rows = {"closed_book": table3.get("closed_book") or [], **table3_lm}
    return [
        "### From the LM-pretrained retriever (paper: T5-base retriever)", "",
        "The same Algorithm 2 runs with the retriever starting from the world's span-corruption toy T5 "
        "(`scripts/pretrain_toy_lm.py`, the Table 1 LM init: `retriever.model=<its folder>`) with no retrieval "
        "training before them (`warm_start.retriever_steps=0`), and the reader of the runs above "
        "(`warm_start.from_run`): only the retriever's init differs. Closed book reads no retriever; its row is the "
        "one above. In the paper the frozen T5 retriever is below closed book, and the corrector and exhaustive "
        "training lift it to within a few points of the GTR rows.", "",
        table3_markdown(rows, PAPER_TABLE3_T5), "",
        recall_markdown(rows), "",
        "Against the paper's T5 rows (computed):", "",
        *table3_comparison(rows, TABLE3, PAPER_TABLE3_T5), "",
    ]


def render(report: Report) -> list[str]:
    """The EM and answer-recall tables, their figure, the paper's claims against them, and the same from the LM
    init."""
    found = report.results["table3"]
    table3 = found["runs"]
    figure = report.figures / "table3_em.png"
    remove_temporaries_of(figure)  # a killed report's
    plotted = plot_table3(table3, figure)
    lines = [
        "## Table 3 in miniature: retrieval-augmented QA (Algorithm 2)",
        "",
        "Tiny FiD reader and retriever, warm-started once (the stand-ins for T5 / GTR pre-training) in the first "
        "run; every other run reuses those stages (`warm_start.from_run`), so all strategies start from the same "
        "models. Exact match on the dev sets of the three toy question families; exhaustive re-embeds the corpus "
        "every `strategy.refresh_every` steps. The retriever trains only once the reader's answer likelihoods "
        "discriminate between passages (`pdist_gate`, docs/rlm_toy.md): a run whose gate never opened kept the "
        "warm-start retriever, i.e. it is a frozen-retriever run whatever its strategy.",
        "",
        table3_markdown(table3),
        "",
        "Answer recall@4 at the end (mean ± std over seeds) and, for the HotPotQA-like family, the share of its gold "
        "passages the reader was given (the retrieval the corrector has to track):",
        "",
        recall_markdown(table3),
        "",
    ]
    return lines + figure_lines(plotted, "Table 3 exact match") + [
        "### Against the paper (computed)", "", *table3_comparison(table3, TABLE3),
        "",
        "The HotPotQA-like family is toy world version 3's (docs/toy_world.md): bridge questions whose answer passage "
        "names the question's entity, and comparisons of two people. Whether the reader or the retriever limits EM: "
        "`python scripts/diagnose_rlm.py --run <runs>/table3/corrector-seed0 --read` (the reader given only the gold "
        "passages; docs/rlm_toy.md).",
        "",
        *paragraph(rlm_analysis(table3)),
        *lm_lines(table3, found["lm"]),
    ]


SECTION = register(Section(
    name="table3", order=30,
    help="Algorithm 2 (paper Table 3): closed book, frozen retriever, corrector, exhaustive, all from one shared warm "
         "start (`warm_start.from_run`); EM on the three toy datasets, steps/s; and frozen / corrector / exhaustive "
         "from the paper's T5 retriever init (the world's toy T5, no retrieval warm start, the same reader): 21 runs "
         "with 3 seeds, 42 min with --jobs 2 on 2 cores (the shared reader warm start and the RLM's in-loop "
         "evaluations dominate).",
    full=FULL, quick=QUICK, runs=runs, render=render, collect=collect, prepare=prepare,
    budget_note=lambda budget: f"Algorithm 2 `{' '.join(budget.rlm) or '(configs/toy/rlm.yaml as is)'}`"))

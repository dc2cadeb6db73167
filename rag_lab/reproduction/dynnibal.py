"""The reproduction's `dynnibal` section: seed 001 as its paper runs it, on a described world
(docs/toy_world.md: the questions name no one in full, so exhaustive stays far below R@1 90), from the
LM-pretrained init (the paper's RoBERTa-base; seed 000's T5-base) and from a retrieval-pretrained one (GTR-like: the
other world's LM, then trained in-batch on that world's questions, so it has seen none of this world's people).

Rows: uniform negatives; Dynnibal with the paper's schedule (uniform warm start, Nyström refreshes every w steps,
one full refresh); Dynnibal "+0" (nothing re-encoded: its trees stay over the stale buffer, seed 000's Table 1 row);
SNM holding as many full-dimension vectors on the device as Dynnibal does (3 d' + s'); exhaustive refreshes, every w
steps and, as a control for Dynnibal's two full encodings, once every warm-start length. What is
compared is the paper's claim: Dynnibal closes more than half of the uniform -> exhaustive R@1 gap at a small memory
share and beats SNM at equal memory (the latter decided by rag_lab/reproduction/verdict.py).

The equal-cost controls test the paper's cost claims as written: SNM re-encoding as many passages as Dynnibal does;
SNM with 10/3x and 10x Dynnibal's device memory (its NQ table: SNM at 1% and 3% against Dynnibal's 0.3%; its 10%,
33x, is more than the toy corpus: exhaustive is SNM at the whole corpus); and Dynnibal with its host cache at the
paper's d'/d (128 of 768), which also lowers its device memory below SNM's at equal memory."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from rag_lab.experiments import (
    RECALL_AT,
    cell,
    curve_table,
    gap_closed,
    gap_share,
    gap_shares_line,
    mean_recall,
    recall_points,
    retrieval_curve,
)
from rag_lab.reproduction.plan import RETRIEVER_CONFIG, Plan, Run, build_lm, init_model
from rag_lab.reproduction.sections import Report, Section, register
from rag_lab.reproduction.verdict import compare, compare_variants, ordered
from rag_train.config import load_config
from rag_train.strategies import overrides_read_by
from rag_train.train.schema import RetrieverTrainConfig

INITS = {"lm": "LM-pretrained init (paper: RoBERTa-base; seed 000: T5-base)",
         "pretrained": "retrieval-pretrained init (GTR-like: trained in-batch on another described world)"}
# folder name: (label, strategy, overrides after the budget's)
ROWS = {
    "uniform": ("uniform", "uniform", ()),
    "dynnibal-plus0": ('Dynnibal "+0" (stale trees, no re-encoding)', "dynnibal",
                       ("strategy.warm_start_steps=0", "strategy.full_refresh_step=0", "strategy.refresh_every=0")),
    "dynnibal": ("Dynnibal (warm start, refreshes, full refresh)", "dynnibal", ()),
    "snm": ("SNM at Dynnibal's device memory", "snm", ()),
    "exhaustive": ("exhaustive", "exhaustive", ()),
    # a control: as many corpus passes as Dynnibal's two full encodings, spent on exact refreshes instead
    "exhaustive-rare": ("exhaustive, refreshed once per warm start's length", "exhaustive",
                        ("strategy.refresh_every={warm_start_steps}",)),
    # the equal-cost controls: Dynnibal's re-encoded passages and 10/3x, 10x its device memory given to SNM
    "snm-equal-reencoding": ("SNM re-encoding as many passages as Dynnibal", "snm",
                             ("strategy.snm_targets={snm-equal-reencoding}",)),
    "snm-3x": ("SNM at 10/3x Dynnibal's device memory", "snm", ("strategy.snm_targets={snm-3x}",)),
    "snm-10x": ("SNM at 10x Dynnibal's device memory", "snm", ("strategy.snm_targets={snm-10x}",)),
    "dynnibal-paper-ratio": ("Dynnibal, host cache at the paper's d'/d (128 / 768)", "dynnibal",
                             ("strategy.landmarks={paper_landmarks}",)),
}
PAPER_LOW_DIM = 128 / 768  # seed 001's d'/d: its host cache's share of the buffer
MEMORY_MULTIPLES = {"snm-3x": 10 / 3, "snm-10x": 10.0}  # its SNM at 1% and 3% against Dynnibal's 0.3%
CONTROLS = ("snm-equal-reencoding", "snm-3x", "snm-10x", "exhaustive-rare")  # the scheduled Dynnibal against each



@dataclass(frozen=True)
class DynnibalBudget:
    world: tuple[int, int]  # the described world the rows are compared on (passages, toy seed)
    other_world: tuple[int, int]  # the described world its GTR-like init is trained on
    pretrain: tuple[str, ...]  # that init's in-batch training
    overrides: tuple[str, ...]  # every run's (Dynnibal's schedule keys included)


FULL = DynnibalBudget(world=(6000, 1), other_world=(3000, 0),
                      pretrain=("train.steps=1000", "train.batch_size=32", "train.eval_every=0"),
                      overrides=("train.steps=1500", "train.eval_every=250", "strategy.warm_start_steps=500",
                                 "strategy.full_refresh_step=1000"))
QUICK = DynnibalBudget(world=(300, 1), other_world=(300, 0), pretrain=("train.steps=6", "train.eval_every=0"),
                       overrides=("train.steps=8", "train.eval_every=8", "strategy.refresh_every=2",
                                  "strategy.warm_start_steps=3", "strategy.full_refresh_step=5", "strategy.landmarks=8",
                                  "strategy.nystrom_samples=32", "strategy.trees=2", "data.max_eval_examples=16"))


def described_world(plan: Plan, name: str) -> list[str]:
    """The overrides of the section's world ("world") or of its GTR-like init's ("other-world"), under dynnibal/."""
    budget = plan.budget_of(SECTION)
    passages, seed = budget.world if name == "world" else budget.other_world
    return [f"data.toy_dir={plan.runs / 'dynnibal' / name}", f"data.toy_passages={passages}",
            f"data.toy_seed={seed}", "data.toy_retrieval=described"]


def lm(plan: Plan, world: str = "world"):
    """The T5 / RoBERTa stand-in on one of the section's described worlds (cached beside it)."""
    return plan.lm_config(*described_world(plan, world), *plan.budget.lm)


def pretrain(plan: Plan) -> Run:
    """The GTR stand-in: the other described world's LM, trained in-batch on its questions (other people than the
    compared world's)."""
    return Run("train_retriever.py", RETRIEVER_CONFIG, plan.runs / "dynnibal" / "pretrain",
               ["train.tracker=null", *described_world(plan, "other-world"),
                f"retriever.model={lm(plan, 'other-world').folder()}", "strategy.name=in_batch",
                *plan.budget_of(SECTION).pretrain])


@functools.cache
def scheduled(overrides: tuple[str, ...]) -> RetrieverTrainConfig:
    """The scheduled Dynnibal row's config under the budget's `overrides` (its sizes and schedule set the controls'
    sizes), loaded once."""
    return load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, ["strategy.name=dynnibal", *overrides])


def snm_targets_of(plan: Plan) -> int:
    cfg = scheduled(plan.budget_of(SECTION).overrides).strategy
    return equal_memory_targets(cfg.landmarks, cfg.nystrom_samples)


def dynnibal_reencoded(cfg: RetrieverTrainConfig, passages: int) -> int:
    """The passages the scheduled Dynnibal encodes: every target at the warm start's end and at the full refresh,
    the landmarks and the s' regression targets at every other multiple of w after the warm start."""
    s = cfg.strategy
    refreshes = sum(1 for step in range(s.warm_start_steps + 1, cfg.train.steps + 1)
                    if s.refresh_every and step % s.refresh_every == 0 and step != s.full_refresh_step)
    fulls = sum(1 for step in (s.warm_start_steps, s.full_refresh_step) if 0 < step <= cfg.train.steps)
    return fulls * passages + refreshes * (s.landmarks + min(s.nystrom_samples, passages))


def snm_row_targets(plan: Plan) -> dict[str, int]:
    """Every SNM row's targets: at Dynnibal's device memory, at its re-encoded passages (SNM re-samples and re-encodes
    its targets every w steps) and at MEMORY_MULTIPLES of its device memory."""
    budget = plan.budget_of(SECTION)
    cfg = scheduled(budget.overrides)
    equal = snm_targets_of(plan)
    snm_refreshes = cfg.train.steps // cfg.strategy.refresh_every
    return {"snm": equal, "snm-equal-reencoding": round(dynnibal_reencoded(cfg, budget.world[0]) / snm_refreshes),
            **{row: round(equal * multiple) for row, multiple in MEMORY_MULTIPLES.items()}}


def row_sizes(plan: Plan) -> dict[str, int]:
    """The numbers the rows' overrides name: the schedule's warm start, the landmarks at the paper's d'/d of the LM's
    width (the retriever has no projection) and every SNM row's targets, by its row."""
    dim = lm(plan).model.d_model  # both inits' width: the GTR-like one is the other world's LM, trained
    return {"warm_start_steps": scheduled(plan.budget_of(SECTION).overrides).strategy.warm_start_steps,
            "paper_landmarks": round(PAPER_LOW_DIM * dim), **snm_row_targets(plan)}


def run(plan: Plan, init: str, row: str, seed: int) -> Run:
    """One row from `init` ("lm", "pretrained")."""
    _, strategy, extra = ROWS[row]
    budget = plan.budget_of(SECTION)
    extra = [o.format(**row_sizes(plan)) for o in extra]
    model = init_model(init, lambda: lm(plan), lambda: pretrain(plan))
    overrides = overrides_read_by(strategy, (*budget.overrides, f"strategy.snm_targets={snm_targets_of(plan)}"))
    return Run("train_retriever.py", RETRIEVER_CONFIG, plan.runs / "dynnibal" / init / f"{row}-seed{seed}",
               ["train.tracker=null", *described_world(plan, "world"), *model, *overrides, f"strategy.name={strategy}",
                f"train.seed={seed}", *extra])


def runs(plan: Plan) -> list[Run]:
    return [pretrain(plan)] + [run(plan, i, r, seed) for i in INITS for r in ROWS for seed in plan.seeds]


def prepare(plan: Plan, threads) -> None:
    build_lm(lm(plan, "world"), threads)
    build_lm(lm(plan, "other-world"), threads)


def collect(plan: Plan) -> dict:
    """{"runs": {init: {row: [metrics by seed]}}, "passages", "snm_targets" (at equal memory), "targets" (every SNM
    row's), "world"}."""
    world = plan.budget_of(SECTION).world
    return {"runs": {i: plan.paired({r: lambda seed, i=i, r=r: run(plan, i, r, seed) for r in ROWS}) for i in INITS},
            "passages": world[0], "snm_targets": snm_targets_of(plan), "targets": snm_row_targets(plan),
            "world": "described, {} passages, toy_seed {}".format(*world)}


def equal_memory_targets(landmarks: int, nystrom_samples: int) -> int:
    """SNM targets that take the device memory Dynnibal's summary counts: the landmarks, their re-encodings and the
    [d', d] regression weights (3 d' vectors of full dimension) and the s' regression targets."""
    return 3 * landmarks + nystrom_samples


def device_memory_pct(row: str, m: dict, passages: int, targets: dict[str, int]) -> float:
    """Full-dimension vectors an accelerator holds, as % of the whole buffer (seed 001's Mem%)."""
    if row.startswith("dynnibal"):
        return m["strategy_summary"]["device_memory_pct"]
    if row.startswith("exhaustive"):
        return 100.0
    return 0.0 if row == "uniform" else 100.0 * min(targets[row], passages) / passages


def init_table(rows: dict[str, list[dict]], passages: int, targets: dict[str, int]) -> str:
    """One init's rows: device memory, re-embedded passages, R@1/5/20/100 (mean ± sd over seeds)."""
    lines = ["| row | device memory | re-embedded | " + " | ".join(f"R@{k}" for k in RECALL_AT) + " |",
             "|---|---|---|" + "---|" * len(RECALL_AT)]
    for row, runs in rows.items():
        if not runs:
            continue
        memory = device_memory_pct(row, runs[0], passages, targets)
        recalls = " | ".join(cell([m["recall"][k] for m in runs]) for k in RECALL_AT)
        lines.append(f"| {ROWS[row][0]} | {memory:.1f}% | {runs[0]['reembedded_passages']:,} | {recalls} |")
    return "\n".join(lines)


def gap_lines(rows: dict[str, list[dict]], passages: int, targets: dict[str, int]) -> list[str]:
    """The share of the uniform -> exhaustive R@1 gap each row closes (of the means, and per seed in seed order),
    and the verdict on seed 001's claim; nothing unless uniform, Dynnibal and exhaustive ran."""
    low, high, dyn = (mean_recall(rows.get(name, [])) for name in ("uniform", "exhaustive", "dynnibal"))
    if low is None or high is None or dyn is None:
        return []
    lines = [gap_shares_line(rows, "uniform", "exhaustive", ("dynnibal", "dynnibal-plus0", "snm"),
                             {r: label for r, (label, _, _) in ROWS.items()})]
    closed = gap_closed(low, dyn, high)
    memory = device_memory_pct("dynnibal", rows["dynnibal"][0], passages, targets)
    versus = compare("Dynnibal", recall_points(rows["dynnibal"]), "SNM", recall_points(rows.get("snm") or []))
    above = ordered(versus, "Dynnibal")
    verdict = ("undecided (exhaustive is not above uniform: no gap)" if closed is None
               else "not reproduced" if closed <= 0.5 or above is False
               else "undecided" if above is None else "reproduced")
    lines.append(f"Seed 001's claim (Dynnibal closes more than half of the gap at a small memory share and beats SNM "
                 f"at equal memory): **{verdict}** here: Dynnibal closes {gap_share(closed)} at {memory:.1f}% device "
                 f"memory; R@1, Dynnibal against SNM at equal memory (the verdict rule): {versus.summary()}.")
    return lines


def control_lines(rows: dict[str, list[dict]], passages: int, targets: dict[str, int]) -> list[str]:
    """The scheduled Dynnibal against each equal-cost control that ran (R@1, the rule, Holm over them), the verdict
    on the paper's "above SNM with 3-33x its memory" from the memory controls, and Dynnibal with the paper's d'/d
    against SNM at (the scheduled row's, so at least its) equal memory."""
    lines = []
    ran = [row for row in CONTROLS if rows.get(row)]
    if rows.get("dynnibal") and ran:
        memory = {row: device_memory_pct(row, rows[row][0], passages, targets) for row in ran}
        verdicts = dict(zip(ran, compare_variants("Dynnibal", recall_points(rows["dynnibal"]),
                                                  {ROWS[row][0]: recall_points(rows[row]) for row in ran}).values()))
        parts = [f"{ROWS[row][0]} ({memory[row]:.1f}% device memory, {rows[row][0]['reembedded_passages']:,} "
                 f"re-embedded): {verdicts[row].summary()}" for row in ran]
        lines.append(f"The scheduled Dynnibal ({rows['dynnibal'][0]['reembedded_passages']:,} re-embedded) against "
                     f"the equal-cost controls, R@1 (the verdict rule, Holm over the {len(ran)} that ran): "
                     + "; ".join(parts) + ".")
        if all(row in ran for row in MEMORY_MULTIPLES):
            above = [ordered(verdicts[row], "Dynnibal") for row in MEMORY_MULTIPLES]
            word = ("reproduced" if all(above) else "not reproduced" if any(a is False for a in above)
                    else "undecided")
            lines.append(f"Seed 001's claim that Dynnibal stays above SNM given 3-33x its device memory (its NQ "
                         f"table: SNM at 1% and 3% against Dynnibal's 0.3%; 33x is more than this corpus): **{word}** "
                         "here, from the 10/3x and 10x rows above.")
    if rows.get("dynnibal-paper-ratio") and rows.get("snm"):
        paper = rows["dynnibal-paper-ratio"]
        own = paper[0]["strategy_summary"]
        snm_memory = device_memory_pct("snm", rows["snm"][0], passages, targets)
        versus = compare(ROWS["dynnibal-paper-ratio"][0], recall_points(paper), "SNM", recall_points(rows["snm"]))
        lines.append(f"Dynnibal with its host cache at the paper's d'/d ({own['low_dim']} of the width: "
                     f"{own['host_memory_pct']:.1f}% of the buffer in host memory, {own['device_memory_pct']:.1f}% on "
                     f"the device) against SNM at {snm_memory:.1f}%, R@1: {versus.summary()}.")
    return lines


def tree_lines(rows: dict[str, list[dict]], passages: int) -> list[str]:
    """What the Nyström refreshes did to the forest (seed 001 updates its trees in place, 4x faster than a rebuild):
    the share of the rows each Dynnibal row's refreshes rebuilt, over its seeds."""
    parts, every = [], []
    for row in ("dynnibal", "dynnibal-paper-ratio"):
        summaries = [m["strategy_summary"] for m in rows.get(row) or [] if m["strategy_summary"].get("refreshes")]
        if summaries:
            shares = [s["tree_rebuilt_points"] / (s["refreshes"] * passages) for s in summaries]
            every.append(min(shares) == 1.0)
            spread = (f"{100 * shares[0]:.0f}%" if min(shares) == max(shares)
                      else f"{100 * min(shares):.0f}-{100 * max(shares):.0f}%")
            parts.append(f"{ROWS[row][0]}: {summaries[0]['refreshes']} Nyström refreshes, {spread} of the rows "
                         f"rebuilt per refresh ({len(shares)} seed{'s' * (len(shares) > 1)})")
    if not parts:
        return []
    ending = (" No refresh kept a subtree, so these runs cannot time an update against a rebuild "
              "([dynnibal.md](../dynnibal.md) measures why)." if all(every) else "")
    return ["Tree maintenance (seed 001 updates its trees in place where covering and separation still hold, and "
            "rebuilds only the subtrees where they fail): " + "; ".join(parts) + "." + ending]


def dynnibal_section(results: Optional[dict]) -> list[str]:
    """reproduction.md's section from the collected runs (`collect`), or a line saying it did not run."""
    lines = ["## Seed 001 as it runs: Dynnibal with its schedule on a described world", "",
             "The paper's rows (uniform negatives, Dynnibal, SNM at equal memory, exhaustive) and seed 000's "
             "Dynnibal \"+0\"; the schedule, the keys and the earlier runs: [dynnibal.md](../dynnibal.md).", ""]
    if results is None or not any(any(rows.values()) for rows in results["runs"].values()):
        return lines + ["_(not run: `--only dynnibal`)_", ""]
    passages, snm_targets, targets = results["passages"], results["snm_targets"], results["targets"]
    lines += [f"World: {results['world']}; SNM holds {snm_targets} targets (3 d' + s').", ""]
    for init, rows in results["runs"].items():
        if not any(rows.values()):
            continue
        lines += [f"### {INITS[init]}", "", init_table(rows, passages, targets), "",
                  "R@1 by training step (mean over seeds):", "",
                  curve_table({ROWS[r][0]: runs for r, runs in rows.items()}, retrieval_curve), ""]
        lines += [line for text in (*gap_lines(rows, passages, targets), *control_lines(rows, passages, targets),
                                    *tree_lines(rows, passages))
                  for line in (text, "")]
    return lines


def render(report: Report) -> list[str]:
    return dynnibal_section(report.results["dynnibal"])


SECTION = register(Section(
    name="dynnibal", order=70,
    help="seed 001 as its paper runs it, on a described world (6,000 passages, toy_seed 1) from the LM-pretrained "
         "init and a GTR-like one (the other described world's LM trained in-batch on its questions): uniform "
         "negatives, Dynnibal with the warm start / refresh / full-refresh schedule, Dynnibal \"+0\" (no "
         "re-encoding), SNM at Dynnibal's device memory, exhaustive, and the equal-cost controls: exhaustive and SNM "
         "re-encoding as many passages as Dynnibal, SNM at 10/3x and 10x its device memory, Dynnibal with the "
         "paper's d'/d (rag_lab/reproduction/dynnibal.py). 61 runs with 3 seeds, about 7 min each with --jobs 2.",
    full=FULL, quick=QUICK, runs=runs, render=render, collect=collect, prepare=prepare))

"""The reproduction's `generative` section: seed 003 (Np Decoding) where a title cannot be copied.

On a described world (docs/toy_world.md) no question contains its target title; the splits of
rag_train/data/toy_splits.py ask new facts of people seen in training (`seen`) and people never seen (`unseen`,
zero-shot). The generator and the CE encoder are a span-corruption toy T5 of the world (seed 003's pretrained T5).
Tables, each mean ± sd over seeds: (a) vanilla decoding, Np Decoding BASE / ASYNC / CONTRA and the dual encoder;
(b) vanilla and BASE on 100% / 30% / 10% of the training questions; (c) vanilla and BASE at two generator sizes;
(d) zero-shot, the unseen people; (e) multi-hop (mentor_bridge, Recall@2), vanilla and BASE. Computed: Np (best
variant) minus vanilla R-precision on the seen people, and each of the paper's other claims (CONTRA above BASE, data
and parameter efficiency, multi-hop), by the verdict rule of rag_lab/reproduction/verdict.py."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rag_lab.analysis.generative_compare import dense_title_metrics
from rag_lab.experiments import cell, curve_table, seed_mean_curve
from rag_lab.reproduction import evidence
from rag_lab.reproduction.evidence import DENSE_TITLES
from rag_lab.reproduction.plan import RETRIEVER_CONFIG, ROOT, Plan, Run, build_lm
from rag_lab.reproduction.sections import Report, Section, register
from rag_lab.reproduction.verdict import compare, compare_variants, ordered
from rag_train.data.toy_splits import FRACTIONS, make_splits
from rag_train.io import atomic_write_json, read_json
from rag_train.train.lm_pretrain import LMPretrainConfig

GENERATIVE_CONFIG = ROOT / "configs" / "toy" / "generative.yaml"
SPLITS_EVIDENCE = "generative/splits-manifest.json"  # under the evidence folder
# folder name: (label, overrides); ASYNC and CONTRA add the budget's schedule keys
VARIANTS = {"vanilla": ("vanilla decoding", ("np.enabled=false",)),
            "base": ("Np Decoding BASE", ()),
            "async": ("Np Decoding ASYNC", ("np.variant=async",)),
            "contra": ("Np Decoding CONTRA", ("np.variant=contra",))}
COMPARED = ("vanilla", "base")  # the data- and parameter-efficiency tables
# generator sizes: the LM's overrides of configs/toy/lm.yaml (d 64, the retriever's tower) for the large one
SIZES = {"large": ("d 128, 8 heads (the toy generator's shape)", ("model.d_model=128", "model.d_ff=256",
                                                                    "model.num_heads=8")),
         "small": ("d 64, 4 heads", ())}
DEV = ("seen", "unseen")
KS = ("1", "5", "10")
BRIDGE_RECALL = "eval.recall_at=[1,2,10]"  # multi-hop: seed 003 reports Recall@2 (two gold titles)


@dataclass(frozen=True)
class GenerativeBudget:
    world: tuple[int, int]  # the described world (passages, toy seed)
    dev_questions: int  # its splits' dev questions
    overrides: tuple[str, ...]  # every generative run's
    async_schedule: tuple[str, ...]  # ASYNC's schedule keys
    contra_schedule: tuple[str, ...]  # CONTRA's
    dense: tuple[str, ...]  # the dual encoder's overrides


# 12,000 steps: at 6,000 vanilla and BASE were both still rising (docs/generative_retrieval_log.md); the dev curve every
# 2,000 steps shows where they flatten
FULL = GenerativeBudget(world=(6000, 1), dev_questions=300, overrides=("train.steps=12000", "train.eval_every=2000"),
                        # the paper's N = 20 epochs: 64 epochs in 12,000 steps, rebuilds after epochs 20, 40, 60
                        async_schedule=("np.rebuild_every_epochs=20",),
                        contra_schedule=("np.contrastive_steps=1000",),
                        dense=("train.steps=2000", "train.eval_every=500"))
QUICK = GenerativeBudget(world=(300, 1), dev_questions=12,
                         overrides=("train.steps=4", "train.eval_every=0", "train.batch_size=8"),
                         async_schedule=("np.rebuild_every_epochs=0.05",),  # every 2 of the 37 steps an epoch takes
                         contra_schedule=("np.contrastive_steps=2",), dense=("train.steps=6", "train.eval_every=0"))


def dense_titles(run_dir: Path) -> Optional[dict]:
    """A finished dual-encoder run's title-level metrics (computed once into its folder); None if it has not
    finished."""
    path = run_dir / DENSE_TITLES
    if not path.is_file() and (run_dir / "metrics.json").is_file():
        atomic_write_json(path, {"datasets": dense_title_metrics(run_dir, [int(k) for k in KS])})
    return read_json(path) if path.is_file() else None


def run_name(variant: str, seed: int, fraction: int = 100, size: str = "large", bridge: bool = False) -> str:
    return (f"{variant}{'' if fraction == 100 else f'-f{fraction}'}{'' if size == 'large' else f'-{size}'}"
            f"{'-bridge' if bridge else ''}-seed{seed}")


def splits(plan: Plan) -> Path:
    return plan.runs / "generative" / "splits"


def world(plan: Plan) -> list[str]:
    passages, seed = plan.budget_of(SECTION).world
    return [f"data.toy_dir={splits(plan).parent / 'world'}", f"data.toy_passages={passages}",
            f"data.toy_seed={seed}", "data.toy_retrieval=described"]


def lm(plan: Plan, size: str) -> LMPretrainConfig:
    """The T5 stand-in at a generator size (cached beside the section's world)."""
    return plan.lm_config(*world(plan), *plan.budget.lm, *SIZES[size][1])


def data(plan: Plan, fraction: int = 100, bridge: bool = False) -> list[str]:
    folder, prefix = splits(plan), "bridge-" if bridge else ""
    train = folder / ("bridge-train.jsonl" if bridge else f"train-{fraction}.jsonl")
    return ["train.tracker=null", *world(plan), f"data.train={train}",
            f"data.dev=[{folder / f'{prefix}seen-dev.jsonl'},{folder / f'{prefix}unseen-dev.jsonl'}]"]


def run(plan: Plan, variant: str, seed: int, fraction: int = 100, size: str = "large", bridge: bool = False) -> Run:
    budget = plan.budget_of(SECTION)
    schedule = {"async": budget.async_schedule, "contra": budget.contra_schedule}.get(variant, ())
    return Run("train_generative.py", GENERATIVE_CONFIG,
               plan.runs / "generative" / run_name(variant, seed, fraction, size, bridge),
               [*data(plan, fraction, bridge), f"generator.model={lm(plan, size).folder()}", *budget.overrides,
                *VARIANTS[variant][1], *schedule, f"train.seed={seed}", *((BRIDGE_RECALL,) if bridge else ())])


def dense(plan: Plan, seed: int) -> Run:
    """The dual encoder on the same questions, from the world's d 64 LM (read as titles: `dense_titles`)."""
    return Run("train_retriever.py", RETRIEVER_CONFIG, plan.runs / "generative" / f"dense-seed{seed}",
               [*data(plan), f"retriever.model={lm(plan, 'small').folder()}", *plan.budget_of(SECTION).dense,
                f"train.seed={seed}"])


def runs(plan: Plan) -> list[Run]:
    seeds = plan.seeds
    return ([run(plan, v, seed) for v in VARIANTS for seed in seeds]
            + [run(plan, v, seed, fraction=f) for v in COMPARED for f in FRACTIONS[1:] for seed in seeds]
            + [run(plan, v, seed, size="small") for v in COMPARED for seed in seeds]
            + [run(plan, v, seed, bridge=True) for v in COMPARED for seed in seeds]
            + [dense(plan, seed) for seed in seeds])


def prepare(plan: Plan, threads) -> None:
    """The world and its two LMs (cached beside it), then its splits (reused when made with these settings)."""
    for size in SIZES:
        build_lm(lm(plan, size), threads)
    make_splits(splits(plan).parent / "world", splits(plan), plan.budget_of(SECTION).dev_questions)


def finish(plan: Plan) -> None:
    """The dual encoders' title-level metrics, computed once into their folders."""
    for seed in plan.seeds:
        dense_titles(dense(plan, seed).out)


def splits_manifest(plan: Plan) -> Optional[dict]:
    path = splits(plan) / "manifest.json" if plan.evidence is None else plan.evidence / SPLITS_EVIDENCE
    return read_json(path) if path.is_file() else None


def evidence_files(plan: Plan) -> dict[str, Any]:
    manifest = splits_manifest(plan)
    return {} if manifest is None else {SPLITS_EVIDENCE: manifest}


def dense_titles_of(plan: Plan, seed: int) -> Optional[dict]:
    out = dense(plan, seed).out
    if plan.evidence is None:
        return dense_titles(out)
    return evidence.load_title_metrics(plan.evidence, plan.runs, out)


def collect(plan: Plan) -> dict:
    """Each group's rows over the seeds all of them finished (`Plan.paired`); the dense runs' title-level figures."""
    paired = plan.paired
    return {
        "world": "{} passages, toy_seed {}".format(*plan.budget_of(SECTION).world),
        "splits": splits_manifest(plan),
        "main": paired({v: lambda s, v=v: run(plan, v, s) for v in VARIANTS}),
        "fractions": {f: paired({v: lambda s, v=v, f=f: run(plan, v, s, fraction=f) for v in COMPARED})
                      for f in FRACTIONS},
        "sizes": {size: paired({v: lambda s, v=v, size=size: run(plan, v, s, size=size) for v in COMPARED})
                  for size in SIZES},
        "bridge": paired({v: lambda s, v=v: run(plan, v, s, bridge=True) for v in COMPARED}),
        "dense": [m for m in (dense_titles_of(plan, seed) for seed in plan.seeds) if m],
    }


def _value(m: dict, dev: str, key: str) -> Optional[float]:
    values = m["datasets"].get(dev)
    if values is None:
        return None
    return values["r_precision"] if key == "rp" else values["recall"].get(key)


def _row(label: str, runs: list[dict], devs=DEV, keys=("rp", "5", "10")) -> str:
    cells = [cell([_value(m, dev, key) for m in runs]) for dev in devs for key in keys]
    return f"| {label} | {len(runs)} | " + " | ".join(cells) + " |"


def _header(first: str, devs=DEV, keys=("rp", "5", "10")) -> list[str]:
    names = [f"{dev} {'R-prec' if key == 'rp' else f'R@{key}'}" for dev in devs for key in keys]
    return [f"| {first} | runs | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]


def _chance_row(splits: dict, devs=DEV) -> str:
    chance, ceiling = splits.get("chance", {}), splits.get("ceiling", {})
    cells = [f"{chance[f'{dev}-dev'][k]:.1f}" for dev in devs for k in KS]
    limits = ", ".join(f"{dev} {ceiling[f'{dev}-dev']:.1f}" for dev in devs if f"{dev}-dev" in ceiling)
    return (f"| chance: a uniform guess among the people sharing the question's first name (R@1 ceiling of any "
            f"retriever: {limits}) | - | " + " | ".join(cells) + " |")


def _trained_chance_rows(splits: dict) -> list[str]:
    """Per training share, a uniform guess among the people it trains on who share the question's first name (seen
    people only: the unseen were never trained on)."""
    rows = []
    for share in FRACTIONS:
        chance = splits.get("trained_chance", {}).get(f"train-{share}")
        if chance:
            rows.append(f"| chance among the people asked in train-{share} who share the first name | - | "
                        + " | ".join(f"{chance[k]:.1f}" for k in KS) + " | - | - | - |")
    return rows


def np_gain(main: dict[str, list[dict]]) -> list[str]:
    """Np (best variant by mean) minus vanilla, R-precision on the seen people, with the per-seed differences; the
    claim (a gain of at least 4 points) holds where the verdict rule, Holm-adjusted over the variants the best was
    picked from, says the best variant beats vanilla by that much on average."""
    vanilla = [100 * _value(m, "seen", "rp") for m in main.get("vanilla", [])]
    variants = {v: [100 * _value(m, "seen", "rp") for m in runs] for v, runs in main.items() if v != "vanilla" and runs}
    if not vanilla or not variants:
        return ["_(needs vanilla and an Np Decoding variant)_"]
    best = max(variants, key=lambda v: statistics.mean(variants[v]))
    versus = compare_variants("vanilla", vanilla, {VARIANTS[v][0]: values for v, values in variants.items()})
    rule = versus[VARIANTS[best][0]]
    gain = statistics.mean(variants[best]) - statistics.mean(vanilla)
    above = ordered(rule, VARIANTS[best][0])
    verdict = ("not reached" if above is False or gain < 4.0 else "undecided" if above is None else "reached")
    return [f"- Seen people, R-precision: {VARIANTS[best][0]} {statistics.mean(variants[best]):.1f} against vanilla "
            f"{statistics.mean(vanilla):.1f}: **{gain:+.1f} points** (per seed: "
            + ", ".join(f"{d:+.1f}" for d in rule.diffs) + "); seed 003: +4.4 single-hop. A gain of at least 4 "
            f"points: **{verdict}** (the verdict rule, the best of {len(variants)} variants: {rule.summary()})."]


def _claim(claim: str, a: str, a_runs: Optional[list[dict]], b: str, b_runs: Optional[list[dict]], dev: str = "seen",
           key: str = "rp", m: int = 1) -> list[str]:
    """One of seed 003's claims, `a` above `b`, by the verdict rule on their paired seeds' figures (R-precision, or
    recall at `key`, on `dev`); nothing unless both rows ran."""
    a_values, b_values = ([100 * _value(x, dev, key) for x in runs or []] for runs in (a_runs, b_runs))
    if not a_values or not b_values:
        return []
    rule = compare(a, a_values, b, b_values, m=m)
    above = ordered(rule, a)
    verdict = "reproduced" if above else "not reproduced" if above is False else "undecided"
    return [f"- {claim}: **{verdict}** ({rule.summary()})."]


def contra_claim(main: dict[str, list[dict]]) -> list[str]:
    """Seed 003: a contrastively trained CE encoder "further increases the performance by a large margin" (CONTRA
    against BASE), R-precision on the seen people, by the verdict rule; nothing unless both ran."""
    contra, base = VARIANTS["contra"][0], VARIANTS["base"][0]
    return _claim(f"Seen people, R-precision: {contra} against {base} (seed 003: the contrastively trained CE encoder "
                  "\"further increases the performance by a large margin\")", contra, main.get("contra"), base,
                  main.get("base"))


def efficiency_claims(results: dict) -> list[str]:
    """Seed 003's other claims for Np Decoding, BASE against vanilla by the verdict rule: data efficiency (above
    vanilla on each smaller share of the training questions, Holm over the shares), parameter efficiency (the
    paper's form: the smaller Np generator above the larger vanilla one) and multi-hop (Recall@2 on the bridge's seen
    people; the paper reports +5.4)."""
    vanilla, base = VARIANTS["vanilla"][0], VARIANTS["base"][0]
    shares = FRACTIONS[1:]
    lines = []
    for share in shares:
        rows = results["fractions"].get(share, {})
        lines += _claim(f"Data efficiency, {share}% of the training questions, seen R-precision: {base} above "
                        f"{vanilla} (seed 003: data-efficient; Holm over the {len(shares)} shares)",
                        f"{base}, {share}%", rows.get("base"), f"{vanilla}, {share}%", rows.get("vanilla"),
                        m=len(shares))
    small, large = (SIZES[size][0] for size in ("small", "large"))
    lines += _claim(f"Parameter efficiency, seen R-precision: {base} with the smaller generator ({small}) above "
                    f"{vanilla} with the larger one ({large})", f"{base}, {small}",
                    results["sizes"].get("small", {}).get("base"), f"{vanilla}, {large}",
                    results["sizes"].get("large", {}).get("vanilla"))
    bridge = results.get("bridge", {})
    lines += _claim(f"Multi-hop, bridge-seen Recall@2: {base} above {vanilla} (seed 003: +5.4 Recall@2)", base,
                    bridge.get("base"), vanilla, bridge.get("vanilla"), dev="bridge-seen", key="2")
    return lines


def seen_curve(m: dict) -> list[tuple[int, float]]:
    """(step, seen-dev R-precision) at every evaluation of a run, its final one included."""
    points = [(e["step"], e["seen"]["r_precision"]) for e in m.get("history", []) if "seen" in e]
    return points + [(m["steps"], m["datasets"]["seen"]["r_precision"])]


def flattening(main: dict[str, list[dict]]) -> list[str]:
    """Seen-dev R-precision over training, mean over the seeds, and each row's change over its last evaluation
    interval: whether the budget trained vanilla and Np Decoding until their dev curves flatten (seed 003 trains to
    convergence; a gain measured while one row still rises says little)."""
    rows = {VARIANTS[v][0]: runs for v, runs in main.items() if runs}
    changes = []
    for label, runs in rows.items():
        steps, means, _, _ = seed_mean_curve(runs, seen_curve)
        if len(steps) > 1:
            changes.append(f"{label} {100 * (means[-1] - means[-2]):+.1f} (steps {steps[-2]:,} -> {steps[-1]:,})")
    if not changes:
        return []
    return ["Seen-dev R-precision over training (mean over the seeds; the last step is the end of training):", "",
            curve_table(rows, seen_curve), "",
            "Change over the last evaluation interval, R-precision points: " + ", ".join(changes) + "."]


def generative_section(results: Optional[dict]) -> list[str]:
    if not results or not any(results["main"].values()):
        return []
    splits = results["splits"] or {}
    counts = splits.get("counts", {})
    lines = [
        "## Seed 003: generative retrieval where a title cannot be copied (the `generative` section)", "",
        f"Described world ({results['world']}; docs/toy_world.md): no question contains its target title. Trained on "
        f"`train-100` ({counts.get('train-100', '?')} questions) unless a table says otherwise; evaluated on "
        f"`seen-dev` (new facts of people asked in training, {counts.get('seen-dev', '?')} questions) and "
        f"`unseen-dev` (people never asked in training: zero-shot, {counts.get('unseen-dev', '?')}). Generator and CE "
        "encoder: the world's span-corruption toy T5 (seed 003's pretrained T5). The dual encoder is "
        "configs/toy/retriever.yaml from the world's d 64 LM, its passage ranking read as titles. %, mean ± sd.", "",
        "### (a) Main comparison", "", *_header("method"),
        *[_row(VARIANTS[v][0], runs) for v, runs in results["main"].items() if runs]]
    if results["dense"]:
        lines.append(_row("dual encoder (title level)", results["dense"]))
    lines += [_chance_row(splits), "", *np_gain(results["main"]), *contra_claim(results["main"]), ""]
    curve = flattening(results["main"])
    lines += [*curve, ""] if curve else []
    lines += ["### (b) Data efficiency: share of the training questions", "", *_header("method, training questions")]
    for variant in COMPARED:
        for fraction in FRACTIONS:
            runs = results["fractions"].get(fraction, {}).get(variant, [])
            if runs:
                lines.append(_row(f"{VARIANTS[variant][0]}, {fraction}%", runs))
    lines += _trained_chance_rows(splits)
    lines += ["", "### (c) Parameter efficiency: generator size", "", *_header("method, generator")]
    for variant in COMPARED:
        for size, (label, _) in SIZES.items():
            runs = results["sizes"].get(size, {}).get(variant, [])
            if runs:
                lines.append(_row(f"{VARIANTS[variant][0]}, {label}", runs))
    lines += ["", "### (d) Zero-shot: people never seen in training", "", *_header("method", ("unseen",)),
              *[_row(VARIANTS[v][0], runs, ("unseen",)) for v, runs in results["main"].items() if runs]]
    if results["dense"]:
        lines.append(_row("dual encoder (title level)", results["dense"], ("unseen",)))
    lines += [_chance_row(splits, ("unseen",)), ""]
    bridge, devs, keys = results.get("bridge", {}), ("bridge-seen", "bridge-unseen"), ("rp", "2", "10")
    if any(bridge.values()):
        lines += ["### (e) Multi-hop: the mentor_bridge family (two gold titles, the mentor's never in the question)",
                  "", "Trained on `bridge-train` (one pair per gold title); seen: new facts of the mentors of people "
                  "asked in training; unseen: people never asked.", "", *_header("method", devs, keys),
                  *[_row(VARIANTS[v][0], runs, devs, keys) for v, runs in bridge.items() if runs], ""]
    claims = efficiency_claims(results)
    return lines + ["### Seed 003's other claims, by the verdict rule", "", *claims, ""] if claims else lines


def render(report: Report) -> list[str]:
    return generative_section(report.results["generative"])


SECTION = register(Section(
    name="generative", order=80,
    help="seed 003 (Np Decoding) where titles cannot be copied, on a described world (6,000 passages, toy_seed 1) "
         "and its splits (scripts/make_toy_splits.py): vanilla decoding, BASE, ASYNC, CONTRA and the dual encoder; "
         "vanilla and BASE on 30% / 10% of the training questions and with a d 64 generator; seen and unseen "
         "(zero-shot) people; generator and CE encoder the world's span-corruption toy T5 "
         "(rag_lab/reproduction/generative.py); 12,000 steps (ASYNC rebuilding every 20 epochs, the paper's N). About "
         "3-10 min per run on one core; the 39 runs of 3 seeds took 2.6 h with --jobs 2 on 2 cores.",
    full=FULL, quick=QUICK, runs=runs, render=render, collect=collect, prepare=prepare, finish=finish,
    evidence_files=evidence_files))

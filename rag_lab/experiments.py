"""Experiment drivers shared by the comparisons (scripts/compare_strategies.py, rag_lab/reproduction/):
launch one training run as its own process, reuse it once finished, and summarise values over seeds.

Long file: the launch, the per-seed summaries (recall, curves, gap closure at every k) and the two comparison
drivers are used together by every comparison; the reproduction sections import them from this one place."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from rag_lab.reproduction.paper import PAPER_INIT_LABELS, PAPER_TABLE1
from rag_train.config import ConfigError
from rag_train.io import read_json
from rag_train.launch import launch_command, run_script
from rag_train.strategies import overrides_read_by, reads

ROOT = Path(__file__).resolve().parents[1]


def run_once(script: str | Path, config: Optional[str | Path], out: str | Path, overrides: list[str],
             processes: int = 1, threads: Optional[int] = None) -> dict:
    """Metrics of the run in `out`: launched (and resumed from its last checkpoint if it was interrupted)
    unless `out/metrics.json` shows it finished already. One process runs as `python SCRIPT` with accelerate's CPU
    settings in its environment (as `accelerate launch --cpu` would set them), forked from a fork server that
    imported torch and the recipes once (`launch.run_script`), so that a failed run's own exit status reaches the
    caller (`subprocess.CalledProcessError`); several go through `accelerate launch`."""
    out = Path(out)
    metrics = out / "metrics.json"
    if not metrics.is_file():
        config_args = [] if config is None else ["--config", config]
        args = [*config_args, *overrides, f"train.output_dir={out}", "train.resume=true"]
        if processes == 1:  # the script itself, with what `accelerate launch --cpu` sets: its own exit status (2-5)
            cmd = [sys.executable, str(script), *map(str, args)]  # reaches the caller, not the launcher's 1
            env = {**os.environ, "ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "no",
                   "ACCELERATE_DYNAMO_BACKEND": "no", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
            print("+", " ".join(map(str, cmd)), flush=True)
            status = run_script(script, [str(a) for a in args], env)
            if status:
                raise subprocess.CalledProcessError(status, cmd)
        else:
            cmd = launch_command(script, *args, processes=processes, threads=threads)
            print("+", " ".join(map(str, cmd)), flush=True)
            subprocess.run(cmd, check=True)
    return read_json(metrics)


def mean_std(values: list[float]) -> tuple[float, Optional[float]]:
    """Mean and sample standard deviation (None for a single value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def cell(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    """`mean ± std` over seeds (as percentages by default); `-` when there is nothing to show."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean, std = mean_std([scale * v for v in values])
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def recall(m: dict, k: str = "1") -> Optional[float]:
    return m.get("recall", {}).get(k)


def recall_points(runs: list[dict], k: str = "1") -> list[float]:
    """A row's R@k per seed in points (0-100): what the verdict rule compares."""
    return [100 * recall(m, k) for m in runs]


def retrieval_curve(m: dict, k: str = "1") -> list[tuple[int, float]]:
    """(step, recall@k) from a retriever run's history plus its final evaluation."""
    points = []
    for entry in m.get("history", []):
        data = next((v for v in entry.values() if isinstance(v, dict) and "recall" in v), None)
        if data is not None:
            points.append((entry["step"], data["recall"][k]))
    if recall(m, k) is not None:
        points.append((m["steps"], recall(m, k)))
    return points


def late_recall(m: dict, k: str, tail: int) -> float:
    """R@k averaged over a run's last `tail` evaluations, its final one included (one value per step)."""
    return statistics.mean(r for _, r in sorted(dict(retrieval_curve(m, k)).items())[-tail:])


def seed_mean_curve(runs: list[dict], curve) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every run evaluated at, with the mean, min and max over runs."""
    curves = [dict(curve(m)) for m in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    values = [[c[s] for c in curves] for s in steps]
    return steps, [statistics.mean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def curve_table(runs_by_strategy: dict[str, list[dict]], curve, scale: float = 100.0) -> str:
    """Mean over seeds at every evaluated step, one column per strategy."""
    series = {s: dict(zip(*seed_mean_curve(r, curve)[:2])) for s, r in runs_by_strategy.items() if r}
    if not series:
        return "_no finished runs_"
    steps = sorted(set().union(*series.values()))
    lines = ["| step | " + " | ".join(series) + " |", "|---|" + "---|" * len(series)]
    for step in steps:
        values = [f"{scale * v[step]:.1f}" if step in v else "-" for v in series.values()]
        lines.append(f"| {step} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def gap_closed(low: float, mid: float, high: float) -> Optional[float]:
    """Share of the low -> high gap that `mid` closes (None unless high is above low)."""
    return (mid - low) / (high - low) if high - low > 1e-9 else None


def gap_share(closed: Optional[float]) -> str:
    """A share of a gap as printed in the comparisons' gap lines (`n/a` where there was no gap)."""
    return "n/a" if closed is None else f"{100 * closed:.0f}%"


RECALL_AT = ("1", "5", "20", "100")  # the recall@k every Table 1 comparison reports, its gap closure included


def mean_recall(runs: list[dict], k: str = "1") -> Optional[float]:
    """Mean R@k over a row's seeds (None for a row that did not run or a run that did not evaluate R@k)."""
    values = [recall(m, k) for m in runs]
    return statistics.mean(values) if values and None not in values else None


def closure(rows: dict[str, list[dict]], low: str, high: str, row: str, k: str = "1"
            ) -> tuple[Optional[float], list[Optional[float]]]:
    """The share of the low -> high R@k gap that `row` closes, (mid - low) / (high - low): of the means over seeds,
    and per seed (runs paired in seed order); None where there is no gap or R@k was not evaluated."""
    def share(lo: Optional[float], mid: Optional[float], hi: Optional[float]) -> Optional[float]:
        return None if None in (lo, mid, hi) else gap_closed(lo, mid, hi)

    means = share(*(mean_recall(rows[name], k) for name in (low, row, high)))
    return means, [share(*(recall(m, k) for m in runs)) for runs in zip(rows[low], rows[row], rows[high])]


def gap_shares_line(rows: dict[str, list[dict]], low: str, high: str, closers, labels: dict[str, str]) -> str:
    """`R@1 of the means: LOW a, HIGH b (a gap of c points). Share of it closed: ...`: each of `closers` that ran, of
    the means and per seed (runs paired in seed order). `low` and `high` must have run."""
    lo, hi = mean_recall(rows[low]), mean_recall(rows[high])
    parts = []
    for row in closers:
        if rows.get(row):
            means, per_seed = closure(rows, low, high, row)
            parts.append(f"{labels[row]} {gap_share(means)} (per seed: {', '.join(map(gap_share, per_seed))})")
    return (f"R@1 of the means: {low} {100 * lo:.1f}, {high} {100 * hi:.1f} (a gap of {100 * (hi - lo):.1f} points). "
            "Share of it closed: " + "; ".join(parts) + ".")


def closure_table(rows: dict[str, list[dict]], low: str, high: str, closers, labels: dict[str, str],
                  paper: dict[str, dict[str, dict[str, float]]]) -> Optional[str]:
    """Markdown: the low -> high gap of the means at every k of RECALL_AT, the share of it each of `closers` that ran
    closes (of the means, and per seed) and, for each of `paper`'s tables ({label: {row: {k: recall}}}) that has the
    row, the paper's share at the same k; `n/a` where there is no gap, `-` where R@k was not evaluated. R@1 alone
    hides a corrector that ranks the top better and the tail worse. None unless low and high ran."""
    if not rows.get(low) or not rows.get(high):
        return None

    def points(k: str) -> str:
        lo, hi = mean_recall(rows[low], k), mean_recall(rows[high], k)
        return "-" if lo is None or hi is None else f"{100 * lo:.1f} → {100 * hi:.1f}"

    lines = [f"| {low} → {high} closure | " + " | ".join(f"R@{k}" for k in RECALL_AT) + " |",
             "|---|" + "---|" * len(RECALL_AT),
             f"| {low} → {high}, means | " + " | ".join(map(points, RECALL_AT)) + " |"]
    for row in (r for r in closers if rows.get(r)):
        evaluated = [all(recall(m, k) is not None for name in (low, row, high) for m in rows[name]) for k in RECALL_AT]
        shares = [closure(rows, low, high, row, k) for k in RECALL_AT]
        lines.append(f"| {labels[row]}: of the means | " + " | ".join(
            gap_share(means) if ok else "-" for ok, (means, _) in zip(evaluated, shares)) + " |")
        lines.append(f"| {labels[row]}: per seed | " + " | ".join(
            ", ".join(map(gap_share, seeds)) if ok else "-" for ok, (_, seeds) in zip(evaluated, shares)) + " |")
        for label, table in paper.items():
            if row in table:
                lines.append(f"| {labels[row]}: paper, {label} | " + " | ".join(
                    gap_share(gap_closed(table[low][k], table[row][k], table[high][k])) for k in RECALL_AT) + " |")
    return "\n".join(lines)


GAP = ("stale", "corrector", "exhaustive")  # the gap the corrector closes: its low end, the corrector, its high end


def gap_means(rows: dict[str, list[dict]], value=lambda m: recall(m, "1")) -> Optional[dict[str, float]]:
    """Mean `value` (R@1) of stale, corrector and exhaustive over their seeds, or None unless all three ran."""
    return {s: statistics.mean(value(m) for m in rows[s]) for s in GAP} if all(rows.get(s) for s in GAP) else None


def gap_report(rows: dict[str, list[dict]], tail: int = 4) -> Optional[str]:
    """The share of the stale -> exhaustive R@1 gap the corrector closes, of the means and per seed (the seeds in the
    order they ran), at the last step and averaged over the last `tail` evaluations of each run (one evaluation of 500
    questions moves by a few points); None unless all three strategies ran."""
    if gap_means(rows) is None:
        return None
    lines = []
    for label, value in (("at the last step", lambda m: recall(m, "1")),
                         (f"over the last {tail} evaluations", lambda m: late_recall(m, "1", tail))):
        means = gap_means(rows, value)
        per_seed = [gap_closed(*map(value, runs)) for runs in zip(*(rows[s] for s in GAP))]
        lines.append(f"R@1 {label}: stale {100 * means['stale']:.1f}, corrector {100 * means['corrector']:.1f}, "
                     f"exhaustive {100 * means['exhaustive']:.1f}; the corrector closes "
                     f"{gap_share(gap_closed(means['stale'], means['corrector'], means['exhaustive']))} "
                     f"of the gap of the means (per seed: {', '.join(gap_share(x) for x in per_seed)})")
    return "\n".join(lines)


def batching_table(results: dict[str, list[dict]]) -> str:
    """Markdown table of `train.batching` runs ({label: metrics of each seed}): recall@k and MRR@10 as mean ± std
    over seeds, steps/s (training steps only), peak memory (the recipe's `peak_memory_mib`) and the mean ratio of
    the passage tower's gradient norm to the query tower's."""
    first = next(iter(results.values()))[0]
    ks = sorted(first["recall"], key=int)
    lines = ["| setup | " + " | ".join(f"R@{k}" for k in ks) + " | MRR@10 | steps/s | peak MiB | ‖∇g‖/‖∇f‖ |",
             "|---|" + "---|" * (len(ks) + 4)]
    for label, runs in results.items():
        recalls = " | ".join(cell([r["recall"][k] for r in runs]) for k in ks)
        probed = any(probe_values(r) for r in runs)
        speed = "- (probed)" if probed else f"{statistics.mean(r['steps_per_second'] for r in runs):.2f}"
        memory = max(r["peak_memory_mib"] for r in runs)
        ratio = cell([r.get("grad_ratio_passage_query") for r in runs], scale=1.0, digits=2)
        lines.append(f"| {label} | {recalls} | {cell([r['mrr@10'] for r in runs])} | {speed} | {memory:.0f} | "
                     f"{ratio} |")
    return "\n".join(lines)


PROBED_LOSSES = {"banks": "as trained (with the banks)", "no_bank_rows": "without the banked query rows M_q",
                 "no_banks": "banks hidden (GradAccum's loss)"}
PROBED_VALUES = {"grad_norm_passage": "‖∇g‖", "grad_norm_query": "‖∇f‖",
                 "grad_ratio_passage_query": "‖∇g‖/‖∇f‖ (median)",
                 "dloss_dpassage": "‖∂L/∂V‖", "dloss_dquery": "‖∂L/∂Q‖", "passage_norm": "mean ‖v‖",
                 "query_norm": "mean ‖q‖", "fresh_minus_banked_score": "fresh − banked score"}


def probe_values(metrics: dict, skip: int = 50) -> dict[str, Optional[float]]:
    """A `batching.probe_gradients` run's per-step probe series reduced as the probe table reports them: per probed
    loss and value (`<loss>/<value>`), the mean over the steps after the first `skip` (the median for the ratio: a
    step whose query gradient nearly vanishes gives a ratio of 1,000); None where the run has no more steps; {}
    for a run without the probe. A run's evidence keeps these (`probe_summary`) instead of the series."""
    if "probe_summary" in metrics:
        return metrics["probe_summary"]
    by_step, out = metrics.get("by_step", {}), {}
    for variant in PROBED_LOSSES:
        for key in PROBED_VALUES:
            series = by_step.get(f"probe/{variant}/{key}")
            if series:
                average = statistics.median if key.startswith("grad_ratio") else statistics.mean
                out[f"{variant}/{key}"] = average(series[skip:]) if len(series) > skip else None
    return out


def probe_table(results: dict[str, list[dict]], skip: int = 50) -> str:
    """ContAccum's `batching.probe_gradients` runs of `results` (others are left out): per setup and per loss
    computed at the run's own weights each step, `probe_values` (then mean ± sd over seeds): both towers' gradient
    norms and their ratio (seed 002's Figure 5), the loss's gradient with respect to the fresh passage and query
    vectors, the vectors' norms and the fresh-minus-banked score."""
    lines = ["| setup | loss at the step's weights | " + " | ".join(PROBED_VALUES.values()) + " |",
             "|---|---|" + "---|" * len(PROBED_VALUES)]
    for label, runs in results.items():
        values = [probe_values(r, skip) for r in runs]
        for variant, name in PROBED_LOSSES.items():
            if not all(f"{variant}/grad_norm_query" in v for v in values):
                continue
            cells = [cell([v.get(f"{variant}/{key}") for v in values], scale=1.0, digits=3) for key in PROBED_VALUES]
            lines.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_strategies(config: str | Path, strategies: list[str], seeds: list[int], runs: Path, overrides: list[str],
                       processes: int = 1) -> str:
    """Algorithm 1 once per (strategy, seed), same config and steps, each run in `runs/<strategy>-seed<seed>`
    (finished ones reused): a markdown table of recall@k, MRR@10 (mean ± std over seeds) and wall time, then R@1 at
    every evaluated step (mean over seeds: has the curve flattened?) and, with stale and exhaustive among the
    strategies, the share of their gap every other one closes at R@1, R@5, R@20 and R@100 beside the paper's (both
    of its inits), then the corrector's R@1 share at the last step and over the last evaluations. Each strategy gets
    the overrides it reads (a strategy refuses another's key); one that no strategy compared reads is refused before
    any run."""
    for item in overrides:
        key = item.split("=", 1)[0]
        if not any(reads(strategy, key) for strategy in strategies):
            raise ConfigError(f"override {item!r}: none of the strategies compared ({', '.join(strategies)}) reads "
                              f"{key}")
    rows = []
    for strategy in strategies:
        own = overrides_read_by(strategy, overrides)
        results = [run_once(ROOT / "scripts" / "train_retriever.py", config, runs / f"{strategy}-seed{seed}",
                            [f"strategy.name={strategy}", f"train.seed={seed}", *own], processes)
                   for seed in seeds]
        rows.append((strategy, results))
    ks = sorted(rows[0][1][0]["recall"], key=int)
    lines = ["| strategy | re-embedded | " + " | ".join(f"R@{k}" for k in ks) + " | MRR@10 | wall s |",
             "|---|---|" + "---|" * (len(ks) + 2)]
    for strategy, results in rows:
        recalls = " | ".join(cell([r["recall"][k] for r in results]) for k in ks)
        lines.append(f"| {strategy} | {results[0]['reembedded_passages']} | {recalls} | "
                     f"{cell([r['mrr@10'] for r in results])} | "
                     f"{statistics.mean(r['wall_seconds'] for r in results):.0f} |")
    by_strategy = dict(rows)
    lines += ["", "R@1 by training step (mean over seeds):", "", curve_table(by_strategy, retrieval_curve)]
    closers = [s for s in strategies if s not in ("stale", "exhaustive")]
    paper = {PAPER_INIT_LABELS[init]: table for init, table in PAPER_TABLE1.items()}
    closures = closure_table(by_strategy, "stale", "exhaustive", closers, {s: s for s in strategies}, paper)
    gap = gap_report(by_strategy)
    return "\n".join(lines + [part for text in (closures, gap) if text is not None for part in ("", text)])


def _comparison_parser(description: str, runs: str) -> argparse.ArgumentParser:
    """The arguments every comparison driver takes: config, seeds, run folder, table file, config overrides."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=str(ROOT / "configs" / "toy" / "retriever.yaml"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--runs", default=runs)
    parser.add_argument("--out", default=None, help="markdown file for the table (printed either way)")
    parser.add_argument("overrides", nargs="*")
    return parser


def _publish(table: str, what: str, started: float, out: Optional[str]) -> None:
    """Print the table (and on stderr what it took), and write it to `out` if given."""
    print(table)
    print(f"\n{what} in {time.time() - started:.0f} s", file=sys.stderr)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(table + "\n")


def compare_strategies_main(argv: Optional[list[str]] = None) -> None:
    """`scripts/compare_strategies.py`: Algorithm 1 once per strategy (same config, steps and seeds), one
    markdown table; each run its own process and folder under --runs, a finished run reused."""
    parser = _comparison_parser(compare_strategies_main.__doc__, "runs/compare")
    parser.add_argument("--strategies", nargs="+",
                        default=["in_batch", "uniform", "stale", "corrector", "exhaustive", "snm", "negative_cache"])
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.time()
    table = compare_strategies(args.config, args.strategies, args.seeds, Path(args.runs), args.overrides,
                               args.processes)
    _publish(table, f"{len(args.strategies)} strategies x {len(args.seeds)} seeds", started, args.out)


def batching_setups(local: int, micros: list[int], banks: list[int], uniform: int = 0) -> dict[str, list[str]]:
    """label -> overrides, in seed 002's Table 1 order at (micros[0], banks[0]) (`uniform` > 0 adds ContAccum with
    that many uniform negatives per question, so that its hard-negative bank M_h fills, with and without M_h), then
    its Figure 3 sweep: ContAccum with and without M_q at the other bank sizes, and GradAccum, ContAccum (every bank
    size) and in-batch at N_total for the other K (K = 1: the dual bank alone, no accumulation)."""
    def accum(name: str, k: int, *extra: str) -> list[str]:
        return [f"train.batch_size={local * k}", f"batching.name={name}", f"batching.micro_batches={k}", *extra]

    def cont(k: int, m: int, *extra: str) -> list[str]:
        return accum("cont_accum", k, f"batching.bank_size={m}", *extra)

    k, m, n = micros[0], banks[0], local
    setups = {
        f"in-batch {n} (what fits)": [f"train.batch_size={n}"],
        f"GradAccum {n}x{k}": accum("grad_accum", k),
        f"GradCache {n}x{k}": accum("grad_cache", k),
        f"ContAccum {n}x{k}, M={m}": cont(k, m),
        f"ContAccum {n}x{k}, passage-only bank M={m} (w/o M_q)": cont(k, m, "batching.bank_queries=false"),
        f"ContAccum {n}x{k}, M={m}, banks emptied each step (w/o past encoders)":
            cont(k, m, "batching.bank_past_encoders=false"),
        # both ablations: a passage-only bank holding only vectors of the step's own weights (no stale columns)
        f"ContAccum {n}x{k}, passage-only bank M={m}, banks emptied each step (w/o M_q, w/o past encoders)":
            cont(k, m, "batching.bank_queries=false", "batching.bank_past_encoders=false"),
        f"in-batch {n * k} (a card that fits it)": [f"train.batch_size={n * k}"],
    }
    if uniform:  # M_h is the official code's, not the paper's text; with in-batch negatives alone it stays empty
        negatives = f"strategy.uniform_negatives={uniform}"
        setups[f"ContAccum {n}x{k}, M={m}, +{uniform} uniform negatives per question"] = cont(k, m, negatives)
        setups[f"ContAccum {n}x{k}, M={m}, +{uniform} uniform negatives per question, w/o M_h"] = cont(
            k, m, negatives, "batching.bank_hard_negatives=false")
    for m in banks[1:]:
        setups[f"ContAccum {n}x{k}, M={m}"] = cont(k, m)
        setups[f"ContAccum {n}x{k}, passage-only bank M={m} (w/o M_q)"] = cont(k, m, "batching.bank_queries=false")
    for k in micros[1:]:
        if k > 1:
            setups[f"GradAccum {n}x{k}"] = accum("grad_accum", k)
        for m in banks:
            setups[f"ContAccum {n}x{k}, M={m}"] = cont(k, m)
        if k > 1:
            setups[f"in-batch {n * k} (a card that fits it)"] = [f"train.batch_size={n * k}"]
    return setups


def batching_sweep_table(results: dict[str, list[dict]], local: int, micros: list[int], banks: list[int]) -> str:
    """Seed 002's Figure 3 as a grid: one row per K (N_total = N_local x K), R@1 mean ± std (R@20 mean) of in-batch
    at N_total, GradAccum and ContAccum at each bank size M; `-` where a setup was not run."""
    def at(label: str) -> str:
        runs = results.get(label)
        if not runs:
            return "-"
        return f"{cell([r['recall']['1'] for r in runs])} ({cell([r['recall'].get('20') for r in runs]).split(' ')[0]})"

    n = local
    lines = ["| K | N_total | in-batch N_total | GradAccum | " + " | ".join(f"ContAccum M={m}" for m in banks) + " |",
             "|---|---|---|---|" + "---|" * len(banks)]
    for k in sorted(set(micros)):
        batch = f"in-batch {n} (what fits)" if k == 1 else f"in-batch {n * k} (a card that fits it)"
        accum = f"in-batch {n} (what fits)" if k == 1 else f"GradAccum {n}x{k}"
        contaccum = " | ".join(at(f"ContAccum {n}x{k}, M={m}") for m in banks)
        lines.append(f"| {k} | {n * k} | {at(batch)} | {at(accum)} | {contaccum} |")
    return "\n".join(lines)


def grad_ratio_curves(results: dict[str, list[dict]], labels: list[str], smooth: int = 25,
                      every: int = 5) -> dict[str, list[list[float]]]:
    """Seed 002's Figure 5 as points: per setup of `labels`, ||grad g|| / ||grad f|| per optimizer step (mean over
    seeds, then a running mean over `smooth` steps), every `every`-th point as [step, value]; setups without the
    series are left out. Small enough to commit beside the runs' evidence, which drops per-step series."""
    curves = {}
    for label in labels:
        series = [r.get("grad_ratio_by_step") for r in results.get(label, [])]
        if not series or not all(series):
            continue
        length = min(map(len, series))
        mean = [statistics.mean(s[i] for s in series) for i in range(length)]
        window = min(smooth, length)
        smoothed = [(window + i, sum(mean[i:i + window]) / window) for i in range(length - window + 1)]
        curves[label] = [[step, value] for step, value in smoothed[::every]]
    return curves


def grad_ratio_figure(curves: dict[str, list[list[float]]], path: Path) -> None:
    """Seed 002's Figure 5 from `grad_ratio_curves`, log scale; dashed: passage-only banks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rag_train.io import atomic_open

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for label, points in curves.items():
        style = "--" if "w/o M_q" in label else ("-" if "ContAccum" in label else ":")
        ax.plot([x for x, _ in points], [y for _, y in points], style, label=label.replace(" (w/o M_q)", ", w/o M_q"))
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("‖∇g‖ / ‖∇f‖ (passage / query tower)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(path, "wb") as handle:
            fig.savefig(handle, dpi=110, format="png")
    finally:
        plt.close(fig)


def batching_runs(local: int, micros: list[int], banks: list[int], hard_negatives: int = 0,
                  probe: bool = False) -> dict[str, tuple[str, list[str]]]:
    """Every setup of `batching_setups` as {label: (run folder name without the seed, its overrides)}; with `probe`
    Table 1's ContAccum runs (`probed_setups`) also probe their gradients, in folders of their own (a run without
    the probe is not reused for it)."""
    probed = probed_setups(local, micros, banks) if probe else []
    out = {}
    for label, extra in batching_setups(local, micros, banks, hard_negatives).items():
        slug = "".join(c for c in label.replace(" ", "_") if c.isalnum() or c in "_-")
        out[label] = ((f"{slug}-probed", [*extra, "batching.probe_gradients=true"]) if label in probed
                      else (slug, extra))
    return out


def probed_setups(local: int, micros: list[int], banks: list[int]) -> list[str]:
    """Table 1's ContAccum and its two passage-only banks (stale, and of the step's own weights)."""
    n, k, m = local, micros[0], banks[0]
    return [f"ContAccum {n}x{k}, M={m}", f"ContAccum {n}x{k}, passage-only bank M={m} (w/o M_q)",
            f"ContAccum {n}x{k}, passage-only bank M={m}, banks emptied each step (w/o M_q, w/o past encoders)"]


def plotted_setups(setups: list[str], local: int, micros: list[int]) -> list[str]:
    """Figure 5's setups: Table 1's K, every option at N_total, each bank with and without M_q (in-batch negatives
    only)."""
    return [label for label in setups
            if f"{local}x{micros[0]}" in label and "emptied" not in label and "uniform" not in label]


def compare_batching_main(argv: Optional[list[str]] = None) -> None:
    """`scripts/compare_batching.py`: seed 002's Table 1 on the toy world (in-batch, GradAccum, GradCache, ContAccum
    at the same N_total = N_local x K), its Figure 3 sweep over K and M and its Figure 5 (the towers' gradient-norm
    ratio per step); each run its own process, a finished run reused."""
    parser = _comparison_parser(compare_batching_main.__doc__, "runs/large_batches")
    parser.add_argument("--local", type=int, default=4, help="N_local: the batch that fits")
    parser.add_argument("--micro", type=int, nargs="+", default=[4],
                        help="K micro-batches (N_total = local x K); the first is Table 1's, the others sweep")
    parser.add_argument("--bank", type=int, nargs="+", default=[64],
                        help="ContAccum bank sizes M; the first is Table 1's, the others sweep")
    parser.add_argument("--sweep-out", default=None, help="markdown file for the K x M grid (with several K or M)")
    parser.add_argument("--hard-negatives", type=int, default=0,
                        help="N > 0: Table 1 adds ContAccum with N uniform negatives per question (its hard-negative "
                             "bank M_h then fills), with and without M_h")
    parser.add_argument("--figure", default=None, help="PNG of the gradient-norm ratio per step")
    parser.add_argument("--probe-out", default=None,
                        help="markdown file: Table 1's ContAccum runs with and without M_q (and without M_q and past "
                             "encoders) run with batching.probe_gradients=true (4x their step's work, same training) "
                             "and their probe table: each tower's gradient with the banks, without M_q's rows and "
                             "without banks")
    args = parser.parse_args(argv)
    if min(args.micro) < 1 or min(args.bank) < 1 or args.local < 1 or args.hard_negatives < 0:
        parser.error("--local, --micro and --bank take positive integers, --hard-negatives a count")

    setups = batching_runs(args.local, args.micro, args.bank, args.hard_negatives, probe=bool(args.probe_out))
    started, results = time.time(), {}
    for label, (slug, extra) in setups.items():
        results[label] = [run_once(ROOT / "scripts" / "train_retriever.py", args.config,
                                   Path(args.runs) / f"{slug}-seed{seed}",
                                   [*args.overrides, *extra, f"train.seed={seed}"], threads=1)
                          for seed in args.seeds]
    _publish(batching_table(results), f"{len(setups)} setups x {len(args.seeds)} seeds", started, args.out)
    if len(args.micro) > 1 or len(args.bank) > 1:
        print()
        _publish(batching_sweep_table(results, args.local, args.micro, args.bank), "the K x M grid", started,
                 args.sweep_out)
    if args.probe_out:
        print()
        probed = probed_setups(args.local, args.micro, args.bank)
        _publish(probe_table({label: results[label] for label in probed}), "the probe table", started, args.probe_out)
    if args.figure:
        grad_ratio_figure(grad_ratio_curves(results, plotted_setups(list(setups), args.local, args.micro)),
                          Path(args.figure))
        print(f"figure: {args.figure}", file=sys.stderr)

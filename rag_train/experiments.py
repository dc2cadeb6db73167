"""Experiment drivers shared by the comparisons (scripts/compare_strategies.py, rag_train/reproduction/):
launch one training run as its own process, reuse it once finished, and summarise values over seeds."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from rag_train.io import read_json
from rag_train.launch import launch_command

ROOT = Path(__file__).resolve().parents[1]


def run_once(script: str | Path, config: Optional[str | Path], out: str | Path, overrides: list[str],
             processes: int = 1, threads: Optional[int] = None) -> dict:
    """Metrics of the run in `out`: launched (and resumed from its last checkpoint if it was interrupted)
    unless `out/metrics.json` shows it finished already. One process runs as `python SCRIPT` with accelerate's CPU
    settings in its environment (as `accelerate launch --cpu` would set them), so that a failed run's own exit
    status reaches the caller (`subprocess.CalledProcessError`); several go through `accelerate launch`."""
    out = Path(out)
    metrics = out / "metrics.json"
    if not metrics.is_file():
        config_args = [] if config is None else ["--config", config]
        args = [*config_args, *overrides, f"train.output_dir={out}", "train.resume=true"]
        env = None
        if processes == 1:  # the script itself, with what `accelerate launch --cpu` sets: its own exit status (2-5)
            cmd = [sys.executable, str(script), *map(str, args)]  # reaches the caller, not the launcher's 1
            env = {**os.environ, "ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "no",
                   "ACCELERATE_DYNAMO_BACKEND": "no", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        else:
            cmd = launch_command(script, *args, processes=processes, threads=threads)
        print("+", " ".join(map(str, cmd)), flush=True)
        subprocess.run(cmd, check=True, env=env)
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
        speed = statistics.mean(r["steps_per_second"] for r in runs)
        memory = max(r["peak_memory_mib"] for r in runs)
        ratio = cell([r.get("grad_ratio_passage_query") for r in runs], scale=1.0, digits=2)
        lines.append(f"| {label} | {recalls} | {cell([r['mrr@10'] for r in runs])} | {speed:.2f} | {memory:.0f} | "
                     f"{ratio} |")
    return "\n".join(lines)


def compare_strategies(config: str | Path, strategies: list[str], seeds: list[int], runs: Path, overrides: list[str],
                       processes: int = 1) -> str:
    """Algorithm 1 once per (strategy, seed), same config and steps, each run in `runs/<strategy>-seed<seed>`
    (finished ones reused): a markdown table of recall@k, MRR@10 (mean ± std over seeds) and wall time."""
    rows = []
    for strategy in strategies:
        results = [run_once(ROOT / "scripts" / "train_retriever.py", config, runs / f"{strategy}-seed{seed}",
                            [f"strategy.name={strategy}", f"train.seed={seed}", *overrides], processes)
                   for seed in seeds]
        rows.append((strategy, results))
    ks = sorted(rows[0][1][0]["recall"], key=int)
    lines = ["| strategy | re-embedded | " + " | ".join(f"R@{k}" for k in ks) + " | MRR@10 | wall s |",
             "|---|---|" + "---|" * (len(ks) + 2)]
    for strategy, results in rows:
        recalls = " | ".join(cell([r["recall"][k] for r in results]) for k in ks)
        lines.append(f"| {strategy} | {results[0]['reembedded_passages']} | {recalls} | "
                     f"{cell([r['mrr@10'] for r in results])} | {statistics.mean(r['wall_seconds'] for r in results):.0f} |")
    return "\n".join(lines)

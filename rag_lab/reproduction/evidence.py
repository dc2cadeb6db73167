"""The reproduction's evidence: one small summary per finished run (its metrics, command and config digest), written
from the run folders into a folder committed with the docs, so that the report can be regenerated and checked
without the run folders, which are not in the repository.

Layout: `<evidence>/<run folder relative to --runs>.json` (e.g. `table1/lm/stale-seed0.json`) and `reproduce.json`
(the seeds, budget, machine and invocations the report names). Everything is written with sorted keys, the runs
folder and the repository replaced by `<runs>` and `<repo>`; per-machine times (the run's wall time, each corpus
pass's seconds) are kept apart under `timing`: the report reads only the wall times' sum from there."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from rag_lab.experiments import probe_values
from rag_train.io import read_json

META = "reproduce.json"
DENSE_TITLES = "title_metrics.json"  # a dual-encoder run's metrics at the title level, beside its metrics.json


class Placeholders:
    """Replaces the runs folder and the repository in paths with `<runs>` / `<repo>`: the same run summarised on
    another machine or checkout gives the same text."""

    def __init__(self, runs: Path, repo: Path):
        pairs = {str(runs.resolve()): "<runs>", f"{runs}/": "<runs>/", str(repo.resolve()): "<repo>"}
        self.pairs = sorted(pairs.items(), key=lambda p: -len(p[0]))  # the longest first: runs may sit in the repo

    def text(self, text: str) -> str:
        for path, name in self.pairs:
            text = text.replace(path, name)
        return text

    def value(self, value: Any) -> Any:
        return json.loads(self.text(json.dumps(value)))


PER_STEP = ("by_step", "grad_ratio_by_step")  # a value per step (thousands in a full run) that no report reads


def split_timing(metrics: dict) -> tuple[dict, dict]:
    """(metrics without per-machine times and per-step series, those times): wall_seconds and each corpus pass's
    seconds. A gradient probe's series are kept reduced as the report reads them (`probe_summary`)."""
    kept = {k: v for k, v in metrics.items() if k != "wall_seconds" and k not in PER_STEP}
    probe = probe_values(metrics)
    if probe:
        kept["probe_summary"] = probe
    timing = {"wall_seconds": metrics["wall_seconds"]} if "wall_seconds" in metrics else {}
    passes = metrics.get("corpus_passes")
    if passes:
        kept["corpus_passes"] = [{k: v for k, v in p.items() if k != "seconds"} for p in passes]
        timing["corpus_pass_seconds"] = [p.get("seconds") for p in passes]
    return kept, timing


def summary(script: str, config: Path, out: Path, overrides: list[str], names: Placeholders) -> Optional[dict]:
    """A finished run's evidence (None when it has not finished): its metrics, the command that ran it, the digest
    of the config.yaml it wrote, and apart from those its times."""
    path = out / "metrics.json"
    if not path.is_file():
        return None
    metrics, timing = split_timing(read_json(path))
    command = ["python", f"scripts/{script}", "--config", str(config), *overrides, f"train.output_dir={out}"]
    config_file = out / "config.yaml"
    digest = hashlib.sha256(names.text(config_file.read_text()).encode()).hexdigest() if config_file.is_file() else None
    evidence = {"command": names.text(" ".join(command)), "config_sha256": digest, "metrics": names.value(metrics),
                "timing": timing}
    if (out / DENSE_TITLES).is_file():  # the dual encoder's title-level figures
        evidence["title_metrics"] = names.value(read_json(out / DENSE_TITLES))
    return evidence


def evidence_path(folder: Path, runs: Path, out: Path) -> Path:
    return folder / f"{out.relative_to(runs)}.json"


def load_metrics(folder: Path, runs: Path, out: Path) -> Optional[dict]:
    """The metrics a run's evidence holds, its wall time put back (the report sums them), or None without one."""
    path = evidence_path(folder, runs, out)
    if not path.is_file():
        return None
    evidence = read_json(path)
    metrics = dict(evidence["metrics"])
    if "wall_seconds" in evidence["timing"]:
        metrics["wall_seconds"] = evidence["timing"]["wall_seconds"]
    return metrics


def load_title_metrics(folder: Path, runs: Path, out: Path) -> Optional[dict]:
    path = evidence_path(folder, runs, out)
    return read_json(path).get("title_metrics") if path.is_file() else None


def read_meta(folder: Path) -> dict:
    """The report's metadata the evidence was written with (FileNotFoundError naming the file when it is missing)."""
    path = folder / META
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no evidence there (write it: python scripts/reproduce.py --report-only "
                                f"--evidence {folder})")
    return read_json(path)

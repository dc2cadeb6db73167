"""The reproduction's sections (`scripts/reproduce.py --only <name>`): a section is one module of this package that
declares its `Section` with `register` when imported; `sections()` imports every module of the package (extra folders
on its `__path__` included) and returns the sections in their declared order, the order they run in, appear in the
report and are offered by `--only`. Adding a section is adding one module. The functions below run, collect and keep
the evidence of all of them through one `Plan`."""

from __future__ import annotations

import fnmatch
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import rag_lab.reproduction as package
from rag_lab.reproduction import evidence
from rag_lab.reproduction.plan import ROOT, Plan, Run, points_into, run_all
from rag_train.io import atomic_write_json
from rag_train.plugins import Registry


@dataclass(frozen=True)
class Report:
    """What a section's part of reproduction.md is written from."""

    results: dict[str, Any]  # every section's collected results, by name (a section may read another's)
    out: Path  # the report's folder: the files a section wrote there itself (large_batches' tables)
    figures: Path  # where the report's figures go (<folder written>/figures/reproduction)


def _nothing(*_: Any) -> None:
    return None


def _no_files(_: Plan) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Section:
    """One section of the reproduction, declared by its module with `register`."""

    name: str  # the value of --only; its results' key
    order: int  # where it runs, appears in the report and in --only's help (the smallest first)
    help: str  # its entry in --only's help: what it runs, and what that costs
    full: Any  # its own budget (a frozen dataclass of its module; None: it has none) for the report's runs
    quick: Any  # the same for --quick: tiny runs on a small world, a smoke test
    runs: Callable[[Plan], list[Run]]  # its training runs, in the order they launch (another section's: reused)
    render: Callable[[Report], list[str]]  # its lines of reproduction.md
    collect: Callable[[Plan], Any] = _nothing  # its results from the finished runs (`Plan.metrics_of`), for render
    prepare: Callable[[Plan, Optional[int]], None] = _nothing  # before its runs (torch threads): LMs, scripts
    finish: Callable[[Plan], None] = _nothing  # after its runs: what is computed from them once
    evidence_files: Callable[[Plan], dict[str, Any]] = _no_files  # what its collect reads beside the runs'
    # summaries, by path under the evidence folder (--evidence writes them, --from-evidence reads them)
    budget_note: Optional[Callable[[Any], str]] = None  # its budget's words in the report's "budgets:" line


REGISTRY = Registry("reproduction section")  # filled by the section modules; `sections()` imports them all


def register(section: Section) -> Section:
    """Add a section to the reproduction (its module calls it at import); TypeError for a duplicate name."""
    return REGISTRY.add(section.name, section, section.runs.__module__)


@functools.cache
def sections() -> dict[str, Section]:
    """Every section, in order: imports the package's modules once, each section module registering its own (after
    the modules that use this one have loaded, so none of them is imported half way)."""
    return REGISTRY.discover(package.__name__, package.__path__, order=lambda name, section: (section.order, name))


@dataclass
class Tally:
    """What one invocation did, for its log entry: wall seconds per section, runs launched and runs found finished."""

    seconds: dict[str, float] = field(default_factory=dict)
    launched: int = 0
    reused: int = 0


def select(runs: list[Run], root: Path, patterns: Optional[list[str]]) -> list[Run]:
    """The runs whose folder under `root` matches one of the shell `patterns` (every run when there are none), with
    every run of `runs` that a chosen one starts from (a warm start, a pretrained retriever), in `runs`' order."""
    if not patterns:
        return runs
    chosen = {run.out for run in runs
              if any(fnmatch.fnmatchcase(run.out.relative_to(root).as_posix(), p) for p in patterns)}
    while True:
        needed = {other.out for run in runs if run.out in chosen for other in runs
                  if any(points_into(o, other.out) for o in run.overrides)}
        if needed <= chosen:
            return [run for run in runs if run.out in chosen]
        chosen |= needed


def execute(plan: Plan, names: list[str], threads: Optional[int], jobs: int = 1,
            match: Optional[list[str]] = None) -> Tally:
    """Runs the sections `names` in order, each run once even where sections share it (the curves reuse Table 1 and
    3), up to `jobs` runs of a section at a time; with `match`, only the runs `select` picks."""
    tally = Tally()
    done: set[Path] = set()
    for name in names:
        section, started = sections()[name], time.time()
        section.prepare(plan, threads)
        runs = [run for run in select(section.runs(plan), plan.runs, match) if run.out not in done]
        done.update(run.out for run in runs)
        for finished_before in run_all(runs, threads, jobs):
            tally.reused += finished_before
            tally.launched += not finished_before
        section.finish(plan)
        tally.seconds[name] = round(time.time() - started, 1)
        print(f"[reproduce] {name}: {tally.seconds[name]:.0f} s", flush=True)
    return tally


def every_run(plan: Plan, names: Optional[list[str]] = None) -> list[Run]:
    """Every section's runs (or only the sections `names`', the runs they reuse from others included), each folder
    once, in the sections' order."""
    chosen = [section for name, section in sections().items() if names is None or name in names]
    return list({run.out: run for section in chosen for run in section.runs(plan)}.values())


def collect(plan: Plan) -> dict:
    """Every section's results from its finished runs (missing runs are left out), and the runs' summed wall time."""
    return {"run_seconds": sum(m.get("wall_seconds", 0.0) for m in plan.found(every_run(plan))),
            "sections": {name: section.collect(plan) for name, section in sections().items()}}


def write_evidence(plan: Plan, folder: Path, meta: dict, only: list[str]) -> int:
    """The summary of every finished run of the sections `only` (the runs they reuse from other sections included),
    their own evidence files and the report's `meta` under `folder` (after collect, which computes what the sections'
    files hold); returns how many runs had finished. Another section's runs in the same runs folder stay out: each
    section's evidence folder holds what its report reads and nothing else."""
    names = evidence.Placeholders(plan.runs, ROOT)
    written = 0
    for run in every_run(plan, only):
        summary = evidence.summary(run.script, run.config, run.out, run.overrides, names)
        if summary is not None:
            atomic_write_json(evidence.evidence_path(folder, plan.runs, run.out), summary)
            written += 1
    for section in (section for name, section in sections().items() if name in only):
        for path, value in section.evidence_files(plan).items():
            atomic_write_json(folder / path, names.value(value))
    atomic_write_json(folder / evidence.META, meta)  # as given: the report names its runs folder
    return written

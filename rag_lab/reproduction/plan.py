"""What every section of the reproduction shares: a training run (`Run`) and launching runs, the toy world and its
LM, the described worlds (and their LMs) several sections train on, and the `Plan` that holds the runs folder, the
seeds and the shared budget, reads finished runs' metrics and keeps the log of invocations."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from rag_lab.experiments import run_once
from rag_lab.reproduction import evidence
from rag_lab.reproduction.budgets import FULL, QUICK
from rag_train.config import load_config
from rag_train.io import CheckError, atomic_write_json, read_json, remove_temporaries_of
from rag_train.train.lm_pretrain import LMPretrainConfig, pretrain_toy_lm

ROOT = Path(__file__).resolve().parents[2]  # the repository: its configs/ and scripts/
RETRIEVER_CONFIG = ROOT / "configs" / "toy" / "retriever.yaml"
RLM_CONFIG = ROOT / "configs" / "toy" / "rlm.yaml"
LM_CONFIG = ROOT / "configs" / "toy" / "lm.yaml"
INITS = ("random", "lm", "pretrained")
INIT_LABELS = {"random": "random init (no counterpart in the paper)", "lm": "LM-pretrained init (paper: T5-base)",
               "pretrained": "retrieval-pretrained init (paper: GTR-base)"}
INVOCATIONS = "invocations.json"  # under --runs: every invocation that ran sections, with its wall time


def build_lm(cfg: LMPretrainConfig, threads: Optional[int] = None) -> None:
    """Pretrains in this process with the runs' torch threads (two threads beside busy cores stall: 10x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        built = pretrain_toy_lm(cfg)
    finally:
        torch.set_num_threads(previous)
    print(f"[reproduce] toy LM {'reused' if built['reused'] else 'trained'}: {built['folder']}", flush=True)


def init_model(init: str, lm: Callable[[], LMPretrainConfig], pretrain: Callable[[], "Run"]) -> list[str]:
    """The `retriever.model` override of an init ("random", "lm", "pretrained"); only that init's model is looked up
    (each lookup loads a config: a section plans hundreds of runs)."""
    return {"random": lambda: [], "lm": lambda: [f"retriever.model={lm().folder()}"],
            "pretrained": lambda: [f"retriever.model={pretrain().out / 'retriever'}"]}[init]()


def world_name(passages: int, seed: int) -> str:
    """A described world's folder name (under `described/`, and in the sections trained on it)."""
    return f"w{passages}-s{seed}"


# ---- runs --------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One training run; its folder is its identity: a folder with metrics.json is a finished run."""

    script: str
    config: Path
    out: Path
    overrides: list[str] = field(default_factory=list)

    def metrics(self) -> Optional[dict]:
        """The finished run's metrics.json (CorruptFileError naming it when it is truncated or corrupt), else None."""
        path = self.out / "metrics.json"
        return read_json(path) if path.is_file() else None

    def execute(self, threads: Optional[int] = None) -> dict:
        return run_once(ROOT / "scripts" / self.script, self.config, self.out, self.overrides, threads=threads)


def points_into(override: str, folder: Path) -> bool:
    """Whether a `key=value` override points at `folder` or inside it (a pretrained retriever, a shared warm start)."""
    value = Path(override.split("=", 1)[-1])
    return value == folder or folder in value.parents


def run_all(runs: list[Run], threads: Optional[int], jobs: int = 1) -> list[bool]:
    """Executes `runs` in order, up to `jobs` at a time; a run whose overrides point into another run's folder starts
    once that run has finished. Returns, per run, whether it had finished before. After a failure nothing more is
    launched; the runs in flight finish, then the failure is raised."""
    before = [run.metrics() is not None for run in runs]
    waits = {run.out: {other.out for other in runs if other is not run and any(points_into(o, other.out)
                                                                               for o in run.overrides)} for run in runs}
    pending, finished = list(runs), set()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        active: dict = {}
        while pending or active:
            for run in [run for run in pending if waits[run.out] <= finished][:jobs - len(active)]:
                pending.remove(run)
                active[pool.submit(run.execute, threads)] = run
            completed, _ = wait(active, return_when=FIRST_COMPLETED)
            for future in completed:
                future.result()  # a failed run's CalledProcessError, after the runs in flight (the pool's exit)
                finished.add(active.pop(future).out)
    return before


def one_init(metrics: dict[Path, Optional[dict]]) -> None:
    """CheckError where rows of one comparison started from different weights (`init_digest` in metrics.json): the
    same LM recipe built on another machine can differ in its last bits, and its runs are then no pairs. Runs that
    recorded no digest (older runs, `tiny`, a hub id) are not checked."""
    digests = {}
    for out, m in metrics.items():
        if m is not None and m.get("init_digest"):
            digests.setdefault(m["init_digest"], out)
    if len(digests) > 1:
        (a, first), (b, second) = list(digests.items())[:2]
        raise CheckError(f"{first} and {second} started from different weights (init_digest {a[:12]} and "
                         f"{b[:12]}): rows compared must share one build of their init; rerun one side from the "
                         "other's model folder")


class Plan:
    """What every section plans its runs from (the runs folder, the seeds, the shared budget, the toy world and the
    described worlds with their LMs) and reads their results through."""

    def __init__(self, runs: Path, seeds: list[int], hidden: list[int], out: Path, evidence: Optional[Path] = None,
                 quick: bool = False):
        """`evidence`: results are read from the runs' summaries there (rag_lab/reproduction/evidence.py), not from
        their folders; `quick`: every section's quick budget (`Section.quick`) and the shared one's."""
        self.runs, self.seeds, self.hidden, self.out, self.evidence = runs, seeds, hidden, out, evidence
        self.quick, self.budget = quick, QUICK if quick else FULL
        self.lm_configs: dict[tuple[str, ...], LMPretrainConfig] = {}
        self.world = [] if self.budget.toy_passages is None else [
            f"data.toy_dir={runs / 'toy-world'}", f"data.toy_passages={self.budget.toy_passages}"]
        self.common = ["train.tracker=null", *self.world]

    def budget_of(self, section: Any) -> Any:
        """A section's own budget (`Section.full` or `Section.quick`) at this plan's size."""
        return section.quick if self.quick else section.full

    def lm_config(self, *overrides: str) -> LMPretrainConfig:
        """configs/toy/lm.yaml with `overrides`, loaded once per plan: every run a section plans (hundreds) names the
        LM it starts from."""
        if overrides not in self.lm_configs:
            self.lm_configs[overrides] = load_config(LMPretrainConfig, LM_CONFIG, list(overrides))
        return self.lm_configs[overrides]

    def lm(self) -> LMPretrainConfig:
        """The T5 stand-in: span corruption on this world's own passages, no labels (cached beside the world)."""
        return self.lm_config(*self.world, *self.budget.lm)

    def described_world(self, world: tuple[int, int]) -> list[str]:
        """The overrides of a described world (passages, toy seed) under `described/`, where every section that trains
        on it finds it (built once)."""
        passages, seed = world
        return [f"data.toy_dir={self.runs / 'described' / world_name(passages, seed)}",
                f"data.toy_passages={passages}", f"data.toy_seed={seed}", "data.toy_retrieval=described"]

    def described_lm(self, world: tuple[int, int]) -> LMPretrainConfig:
        """The T5 stand-in of a described world (cached beside it)."""
        return self.lm_config(*self.described_world(world), *self.budget.lm)

    def metrics_of(self, run: Run) -> Optional[dict]:
        """A finished run's metrics, from its folder or from its evidence; None when it has not finished."""
        return run.metrics() if self.evidence is None else evidence.load_metrics(self.evidence, self.runs, run.out)

    def found(self, runs: list[Run]) -> list[dict]:
        return [m for m in map(self.metrics_of, runs) if m is not None]

    def by_seed(self, runs: dict[str, Callable[[int], Run]]) -> list[dict[str, Optional[dict]]]:
        """Per seed, each row's metrics (None: not finished); CheckError where the finished rows started from
        different weights (`one_init`). Each row's Run is planned once: planning can load a config."""
        planned = [{row: run(seed) for row, run in runs.items()} for seed in self.seeds]
        by_seed = [{row: self.metrics_of(run) for row, run in rows.items()} for rows in planned]
        one_init({run.out: m for rows, found in zip(planned, by_seed) for run, m in zip(rows.values(), found.values())})
        return by_seed

    def complete_seeds(self, runs: dict[str, Callable[[int], Run]]) -> dict[str, list[dict]]:
        """Each row's runs (`runs[row](seed)`) in seed order, from the seeds whose every row has finished: a seed part
        way through would pair its finished rows with other seeds' in the means."""
        complete = [rows for rows in self.by_seed(runs) if all(m is not None for m in rows.values())]
        return {row: [rows[row] for rows in complete] for row in runs}

    def paired(self, runs: dict[str, Callable[[int], Run]]) -> dict[str, list[dict]]:
        """`complete_seeds` for sections that may run in part: a row with no finished run at all is left empty
        instead of emptying the others, and the rest pair over the seeds where every one of them finished (the
        paired tests pair rows by position, so a seed part way through must not shift one row against another)."""
        by_seed = self.by_seed(runs)
        present = {row for rows in by_seed for row, m in rows.items() if m is not None}
        complete = [rows for rows in by_seed if all(rows[row] is not None for row in present)]
        return {row: [rows[row] for rows in complete] if row in present else [] for row in runs}

    def invocations(self) -> list[dict]:
        """The log of earlier invocations that ran sections into this folder (the report lists their commands)."""
        log = self.runs / INVOCATIONS
        return read_json(log) if log.is_file() else []

    def log_invocation(self, entry: dict) -> None:
        """Appends to the log as read now, not at start: another invocation may have appended meanwhile."""
        invocations = self.invocations()
        invocations.append(entry)
        remove_temporaries_of(self.runs / INVOCATIONS)  # a killed invocation's, not a running one's: writes take ms
        atomic_write_json(self.runs / INVOCATIONS, invocations)  # makes the folder

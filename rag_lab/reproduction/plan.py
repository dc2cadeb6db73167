"""Every training run of the reproduction, by section: its script, config, folder and overrides; launching the
runs (a finished run is reused, an interrupted one resumed) and the log of invocations that launched them.

Long file: every section's runs are planned, launched and collected through the one `Plan` (its budget, seeds,
worlds and init models); a section's branches read the others' runs (the described section the pretrained init,
Table 3 the Table 1 reader).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from rag_lab.experiments import compare_batching_main, run_once
from rag_lab.reproduction import corrector_refresh, corrector_regime, described, dynnibal, evidence, generative
from rag_lab.reproduction.budgets import Budget
from rag_lab.reproduction.large_batches import large_batches_outputs
from rag_train.config import load_config
from rag_train.data.toy_splits import FRACTIONS, make_splits
from rag_train.io import atomic_write_json, read_json, remove_temporaries_of
from rag_train.strategies import overrides_read_by
from rag_train.train.lm_pretrain import LMPretrainConfig, pretrain_toy_lm
from rag_train.train.schema import RetrieverTrainConfig

ROOT = Path(__file__).resolve().parents[2]  # the repository: its configs/ and scripts/
RETRIEVER_CONFIG = ROOT / "configs" / "toy" / "retriever.yaml"
RLM_CONFIG = ROOT / "configs" / "toy" / "rlm.yaml"
GENERATIVE_CONFIG = ROOT / "configs" / "toy" / "generative.yaml"
LM_CONFIG = ROOT / "configs" / "toy" / "lm.yaml"
SECTIONS = ("table1", "table3", "ablation", "curves", "synthetic", "large_batches", "dynnibal", "generative",
            "described", "corrector_regime", "corrector_refresh")
INITS = ("random", "lm", "pretrained")
INIT_LABELS = {"random": "random init (no counterpart in the paper)", "lm": "LM-pretrained init (paper: T5-base)",
               "pretrained": "retrieval-pretrained init (paper: GTR-base)"}
TABLE1 = ("in_batch", "stale", "corrector", "exhaustive", "snm", "negative_cache", "dynnibal", "trainable_cache")
TABLE3 = ("closed_book", "frozen", "corrector", "exhaustive")
TABLE3_LM = ("frozen", "corrector", "exhaustive")  # from the LM init; closed book reads no retriever: TABLE3's
CURVES = ("stale", "corrector", "exhaustive")
RLM_CURVES = ("frozen", "corrector", "exhaustive")
SPLITS_EVIDENCE = "generative/splits-manifest.json"  # under the evidence folder
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


def _names(override: str, folder: Path) -> bool:
    """Whether a `key=value` override points at `folder` or inside it (a pretrained retriever, a shared warm start)."""
    value = Path(override.split("=", 1)[-1])
    return value == folder or folder in value.parents


def run_all(runs: list[Run], threads: Optional[int], jobs: int = 1) -> list[bool]:
    """Executes `runs` in order, up to `jobs` at a time; a run whose overrides point into another run's folder starts
    once that run has finished. Returns, per run, whether it had finished before. After a failure nothing more is
    launched; the runs in flight finish, then the failure is raised."""
    before = [run.metrics() is not None for run in runs]
    waits = {run.out: {other.out for other in runs if other is not run and any(_names(o, other.out)
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


@dataclass
class Tally:
    """What one invocation did, for its log entry: wall seconds per section, runs launched and runs found finished."""

    seconds: dict[str, float] = field(default_factory=dict)
    launched: int = 0
    reused: int = 0


class Plan:
    """Every run of every section, by name and folder; the same plan runs them and collects their results."""

    def __init__(self, runs: Path, budget: Budget, seeds: list[int], hidden: list[int], out: Path,
                 evidence: Optional[Path] = None):
        """`evidence`: collect reads the runs' summaries there (rag_lab/reproduction/evidence.py), not their
        folders."""
        self.runs, self.budget, self.seeds, self.hidden, self.out = runs, budget, seeds, hidden, out
        self.evidence = evidence
        self.lm_configs: dict[tuple[str, ...], LMPretrainConfig] = {}
        self.default_hidden = load_config(RetrieverTrainConfig, RETRIEVER_CONFIG).strategy.corrector.hidden
        self.world = [] if budget.toy_passages is None else [f"data.toy_dir={runs / 'toy-world'}",
                                                               f"data.toy_passages={budget.toy_passages}"]
        self.common = ["train.tracker=null", *self.world]

    def pretrain(self) -> Run:
        """The GTR stand-in: Algorithm 1 with in-batch negatives on a toy world with other entities (toy_seed=1)."""
        other = [f"data.toy_dir={self.runs / 'toy-world-seed1'}", "data.toy_seed=1"]
        if self.budget.toy_passages is not None:
            other.append(f"data.toy_passages={self.budget.toy_passages}")
        return Run("train_retriever.py", RETRIEVER_CONFIG, self.runs / "pretrain",
                   ["train.tracker=null", *other, *self.budget.pretrain])

    def lm_config(self, *overrides: str) -> LMPretrainConfig:
        """configs/toy/lm.yaml with `overrides`, loaded once per plan: every run a section plans (hundreds) names the
        LM it starts from."""
        if overrides not in self.lm_configs:
            self.lm_configs[overrides] = load_config(LMPretrainConfig, LM_CONFIG, list(overrides))
        return self.lm_configs[overrides]

    def lm(self) -> LMPretrainConfig:
        """The T5 stand-in: span corruption on this world's own passages, no labels (cached beside the world)."""
        return self.lm_config(*self.world, *self.budget.lm)

    def described_world(self, passages_seed: tuple[int, int], name: str) -> list[str]:
        passages, seed = passages_seed
        return [f"data.toy_dir={self.runs / 'dynnibal' / name}", f"data.toy_passages={passages}",
                f"data.toy_seed={seed}", "data.toy_retrieval=described"]

    def dynnibal_lm(self, world: str = "world") -> LMPretrainConfig:
        """The T5 / RoBERTa stand-in on a described world of the `dynnibal` section (cached beside it)."""
        size = self.budget.dynnibal_world if world == "world" else self.budget.dynnibal_other_world
        return self.lm_config(*self.described_world(size, world), *self.budget.lm)

    def dynnibal_pretrain(self) -> Run:
        """The GTR stand-in of the `dynnibal` section: the other described world's LM, trained in-batch on its
        questions (other people than the compared world's)."""
        return Run("train_retriever.py", RETRIEVER_CONFIG, self.runs / "dynnibal" / "pretrain",
                   ["train.tracker=null", *self.described_world(self.budget.dynnibal_other_world, "other-world"),
                    f"retriever.model={self.dynnibal_lm('other-world').folder()}", "strategy.name=in_batch",
                    *self.budget.dynnibal_pretrain])

    @functools.cached_property
    def dynnibal_config(self):
        """The scheduled Dynnibal row's strategy section (its sizes set SNM's targets; its warm start the control's
        refresh interval), loaded once."""
        overrides = ["strategy.name=dynnibal", *self.budget.dynnibal]
        return load_config(RetrieverTrainConfig, RETRIEVER_CONFIG, overrides).strategy

    def dynnibal_snm_targets(self) -> int:
        cfg = self.dynnibal_config
        return dynnibal.equal_memory_targets(cfg.landmarks, cfg.nystrom_samples)

    def dynnibal_run(self, init: str, row: str, seed: int) -> Run:
        """One row of the `dynnibal` section (rag_lab/reproduction/dynnibal.py) from `init` ("lm", "pretrained")."""
        _, strategy, extra = dynnibal.ROWS[row]
        extra = [o.format(warm_start_steps=self.dynnibal_config.warm_start_steps) for o in extra]
        model = init_model(init, self.dynnibal_lm, self.dynnibal_pretrain)
        budget = overrides_read_by(strategy, (*self.budget.dynnibal,
                                              f"strategy.snm_targets={self.dynnibal_snm_targets()}"))
        return Run("train_retriever.py", RETRIEVER_CONFIG, self.runs / "dynnibal" / init / f"{row}-seed{seed}",
                   ["train.tracker=null", *self.described_world(self.budget.dynnibal_world, "world"),
                    *model, *budget, f"strategy.name={strategy}", f"train.seed={seed}", *extra])

    def generative_world(self) -> list[str]:
        passages, seed = self.budget.generative_world
        return [f"data.toy_dir={self.generative_splits().parent / 'world'}", f"data.toy_passages={passages}",
                f"data.toy_seed={seed}", "data.toy_retrieval=described"]

    def generative_lm(self, size: str) -> LMPretrainConfig:
        """The T5 stand-in of the `generative` section at a generator size (cached beside its world)."""
        return self.lm_config(*self.generative_world(), *self.budget.lm, *generative.SIZES[size][1])

    def generative_splits(self) -> Path:
        return self.runs / "generative" / "splits"

    def generative_data(self, fraction: int = 100, bridge: bool = False) -> list[str]:
        splits, prefix = self.generative_splits(), "bridge-" if bridge else ""
        train = splits / ("bridge-train.jsonl" if bridge else f"train-{fraction}.jsonl")
        return ["train.tracker=null", *self.generative_world(), f"data.train={train}",
                f"data.dev=[{splits / f'{prefix}seen-dev.jsonl'},{splits / f'{prefix}unseen-dev.jsonl'}]"]

    def generative_run(self, variant: str, seed: int, fraction: int = 100, size: str = "large",
                       bridge: bool = False) -> Run:
        schedule = {"async": self.budget.generative_async, "contra": self.budget.generative_contra}.get(variant, ())
        return Run("train_generative.py", GENERATIVE_CONFIG,
                   self.runs / "generative" / generative.run_name(variant, seed, fraction, size, bridge),
                   [*self.generative_data(fraction, bridge), f"generator.model={self.generative_lm(size).folder()}",
                    *self.budget.generative, *generative.VARIANTS[variant][1], *schedule, f"train.seed={seed}",
                    *((generative.BRIDGE_RECALL,) if bridge else ())])

    def generative_dense(self, seed: int) -> Run:
        """The dual encoder on the same questions, from the world's d 64 LM (read as titles: `dense_titles`)."""
        return Run("train_retriever.py", RETRIEVER_CONFIG, self.runs / "generative" / f"dense-seed{seed}",
                   [*self.generative_data(), f"retriever.model={self.generative_lm('small').folder()}",
                    *self.budget.generative_dense, f"train.seed={seed}"])

    def generative_runs(self) -> list[Run]:
        return ([self.generative_run(v, seed) for v in generative.VARIANTS for seed in self.seeds]
                + [self.generative_run(v, seed, fraction=f) for v in generative.COMPARED
                   for f in FRACTIONS[1:] for seed in self.seeds]
                + [self.generative_run(v, seed, size="small") for v in generative.COMPARED for seed in self.seeds]
                + [self.generative_run(v, seed, bridge=True) for v in generative.COMPARED for seed in self.seeds]
                + [self.generative_dense(seed) for seed in self.seeds])

    def prepare_generative(self, threads: Optional[int]) -> None:
        """The world and its two LMs (cached beside it), then its splits (reused when made with these settings)."""
        for size in generative.SIZES:
            build_lm(self.generative_lm(size), threads)
        make_splits(self.generative_splits().parent / "world", self.generative_splits(),
                    self.budget.generative_dev_questions)

    def described_args(self, world: tuple[int, int]) -> list[str]:
        passages, seed = world
        return [f"data.toy_dir={self.runs / 'described' / described.world_name(passages, seed)}",
                f"data.toy_passages={passages}", f"data.toy_seed={seed}", "data.toy_retrieval=described"]

    def described_lm(self, world: tuple[int, int]) -> LMPretrainConfig:
        """The T5 stand-in of a described world of the `described` section (cached beside it)."""
        return self.lm_config(*self.described_args(world), *self.budget.lm)

    def described_pretrain(self) -> Run:
        """The GTR stand-in of the `described` section: the other world's LM trained in-batch on its questions. Its
        toy seed is none of the compared worlds', so it has seen none of their people."""
        other = self.budget.described_other_world
        if other[1] in {seed for _, seed in self.budget.described_worlds}:
            raise ValueError(f"described_other_world {other}: its toy seed is a compared world's (same people)")
        return Run("train_retriever.py", RETRIEVER_CONFIG, self.runs / "described" / "pretrain",
                   ["train.tracker=null", *self.described_args(other),
                    f"retriever.model={self.described_lm(other).folder()}", "strategy.name=in_batch",
                    *self.budget.described_pretrain])

    def described_run(self, world: tuple[int, int], init: str, row: str, seed: int) -> Run:
        """One row of the `described` section (rag_lab/reproduction/described.py) on `world` from `init`."""
        _, strategy, extra = described.ROWS[row]
        model = init_model(init, lambda: self.described_lm(world), self.described_pretrain)
        budget = overrides_read_by(strategy, self.budget.described)
        return Run("train_retriever.py", RETRIEVER_CONFIG,
                   self.runs / "described" / described.world_name(*world) / init / f"{row}-seed{seed}",
                   ["train.tracker=null", *self.described_args(world), *model, *budget, f"strategy.name={strategy}",
                    f"train.seed={seed}", *extra])

    def corrector_regime_run(self, world: tuple[int, int], row: str, seed: int) -> Run:
        """One row of the `corrector_regime` section (rag_lab/reproduction/corrector_regime.py) on `world`, from
        its LM-pretrained init (the described section's world and LM: the same world is built once)."""
        overrides = corrector_regime.row_overrides(row)
        budget = overrides_read_by(corrector_regime.ROWS[row][2], self.budget.corrector_regime)
        return Run("train_retriever.py", RETRIEVER_CONFIG,
                   self.runs / "corrector_regime" / described.world_name(*world) / f"{row}-seed{seed}",
                   ["train.tracker=null", *self.described_args(world),
                    f"retriever.model={self.described_lm(world).folder()}", *budget, *overrides, f"train.seed={seed}"])

    def corrector_refresh_run(self, world: tuple[int, int], row: str, seed: int) -> Run:
        """One row of the `corrector_refresh` section (rag_lab/reproduction/corrector_refresh.py): the
        corrector_regime section's world, LM and budget."""
        budget = overrides_read_by(corrector_refresh.ROWS[row][1], self.budget.corrector_regime)
        return Run("train_retriever.py", RETRIEVER_CONFIG,
                   self.runs / "corrector_refresh" / described.world_name(*world) / f"{row}-seed{seed}",
                   ["train.tracker=null", *self.described_args(world),
                    f"retriever.model={self.described_lm(world).folder()}", *budget,
                    *corrector_refresh.row_overrides(row), f"train.seed={seed}"])

    def table1(self, init: str, strategy: str, seed: int, extra: tuple[str, ...] = ()) -> Run:
        model = init_model(init, self.lm, self.pretrain)
        budget = overrides_read_by(strategy, self.budget.retriever)
        return Run("train_retriever.py", RETRIEVER_CONFIG, self.runs / "table1" / init / f"{strategy}-seed{seed}",
                   [*self.common, *budget, *model, f"strategy.name={strategy}", f"train.seed={seed}", *extra])

    def ablation(self, hidden: int, seed: int) -> Run:
        if hidden == self.default_hidden:  # the Table 1 corrector run is this very run
            return self.table1("random", "corrector", seed)
        run = self.table1("random", "corrector", seed, (f"strategy.corrector.hidden={hidden}",))
        run.out = self.runs / "ablation" / f"corrector-h{hidden}-seed{seed}"
        return run

    def table3(self, strategy: str, seed: int) -> Run:
        holder = self.table3_holder()
        shared = [] if (strategy, seed) == (TABLE3[0], self.seeds[0]) else [f"warm_start.from_run={holder}"]
        return Run("train_rlm.py", RLM_CONFIG, self.runs / "table3" / f"{strategy}-seed{seed}",
                   [*self.common, *overrides_read_by(strategy, self.budget.rlm), f"strategy.name={strategy}",
                    f"train.seed={seed}", *shared])

    def table3_lm(self, strategy: str, seed: int) -> Run:
        """A Table 3 run whose retriever starts from the world's span-corruption toy T5 (the paper's T5-base
        retriever) with no retrieval training, and whose reader is the GTR-like runs' warm-started one."""
        return Run("train_rlm.py", RLM_CONFIG, self.runs / "table3-lm" / f"{strategy}-seed{seed}",
                   [*self.common, *overrides_read_by(strategy, self.budget.rlm),
                    *init_model("lm", self.lm, self.pretrain),
                    "warm_start.retriever_steps=0",  # after the budget's: the later override wins
                    f"strategy.name={strategy}", f"train.seed={seed}", f"warm_start.from_run={self.table3_holder()}"])

    def table3_holder(self) -> Path:
        """The run whose warm-start stages every other Table 3 run reuses (it runs first)."""
        return self.runs / "table3" / f"{TABLE3[0]}-seed{self.seeds[0]}"

    def section(self, name: str) -> list[Run]:
        if name == "table1":
            return [self.pretrain()] + [self.table1(i, s, seed) for i in INITS for s in TABLE1 for seed in self.seeds]
        if name == "table3":
            return [run for seed in self.seeds  # the holder first, then seed by seed, both inits
                    for run in [self.table3(s, seed) for s in TABLE3] + [self.table3_lm(s, seed) for s in TABLE3_LM]]
        if name == "ablation":
            return [self.ablation(h, seed) for h in self.hidden for seed in self.seeds]
        if name == "curves":
            return ([self.pretrain()] + [self.table1(i, s, seed) for i in INITS for s in CURVES for seed in self.seeds]
                    + [self.table3(TABLE3[0], self.seeds[0])]
                    + [self.table3(s, seed) for seed in self.seeds for s in RLM_CURVES])
        if name == "dynnibal":
            return [self.dynnibal_pretrain()] + [self.dynnibal_run(i, r, seed) for i in dynnibal.INITS
                                                 for r in dynnibal.ROWS for seed in self.seeds]
        if name == "generative":
            return self.generative_runs()
        if name == "described":
            return [self.described_pretrain()] + [self.described_run(w, i, r, seed)
                                                  for w in self.budget.described_worlds for i in described.INITS
                                                  for r in described.ROWS for seed in self.seeds]
        if name == "corrector_regime":  # seed by seed over the worlds: a stopped section has every world's first seed
            return [self.corrector_regime_run(w, r, seed) for seed in self.seeds
                    for w in self.budget.corrector_regime_worlds for r in corrector_regime.RUN_ORDER]
        if name == "corrector_refresh":
            return [self.corrector_refresh_run(w, r, seed) for seed in self.seeds
                    for w in self.budget.corrector_regime_worlds for r in corrector_refresh.ROWS]
        if name in ("synthetic", "large_batches"):  # scripts of their own, run by execute
            return []
        raise ValueError(f"unknown section {name!r}; expected one of {SECTIONS}")

    def execute(self, sections: list[str], threads: Optional[int], jobs: int = 1) -> Tally:
        """Runs the sections in order, each run once even where sections share it (the curves reuse Table 1 and 3),
        up to `jobs` runs of a section at a time."""
        tally = Tally()
        done: set[Path] = set()
        for section in sections:
            section_started = time.time()
            if section == "synthetic":
                self.run_synthetic()
            if section in ("table1", "table3", "curves", "large_batches"):
                build_lm(self.lm(), threads)
            if section == "dynnibal":
                build_lm(self.dynnibal_lm("world"), threads)
                build_lm(self.dynnibal_lm("other-world"), threads)
            if section == "large_batches":
                compare_batching_main(self.large_batches_args())
            if section == "generative":
                self.prepare_generative(threads)
            if section == "described":
                for world in (*self.budget.described_worlds, self.budget.described_other_world):
                    build_lm(self.described_lm(world), threads)
            if section in ("corrector_regime", "corrector_refresh"):
                for world in self.budget.corrector_regime_worlds:
                    build_lm(self.described_lm(world), threads)
            runs = [run for run in self.section(section) if run.out not in done]
            done.update(run.out for run in runs)
            for finished_before in run_all(runs, threads, jobs):
                tally.reused += finished_before
                tally.launched += not finished_before
            if section == "generative":
                for seed in self.seeds:
                    generative.dense_titles(self.generative_dense(seed).out)
            tally.seconds[section] = round(time.time() - section_started, 1)
            print(f"[reproduce] {section}: {tally.seconds[section]:.0f} s", flush=True)
        return tally

    def large_batches_args(self) -> list[str]:
        """scripts/compare_batching.py's arguments: seed 002's Table 1, Figure 3 sweep and Figure 5 (with the probe
        of its cause) with its scoring (raw dot products, temperature 1, in-batch negatives only) from the
        LM-pretrained init (its BERT)."""
        table, sweep, figure, probe = large_batches_outputs(self.out)
        return [*self.budget.large_batches, "--seeds", *map(str, self.seeds),
                "--runs", str(self.runs / "large_batches"), "--out", str(table), "--sweep-out", str(sweep),
                "--figure", str(figure), "--probe-out", str(probe),
                *self.common, f"retriever.model={self.lm().folder()}", "strategy.name=in_batch",
                "strategy.uniform_negatives=0", "retriever.normalize=false", "train.temperature=1.0",
                *self.budget.large_batches_runs]

    def synthetic_dir(self) -> Path:
        return self.out / "figures" / "synthetic"

    def run_synthetic(self) -> None:
        if (self.synthetic_dir() / "results.json").is_file():
            print(f"synthetic: reusing {self.synthetic_dir() / 'results.json'}", flush=True)
            return
        cmd = [sys.executable, str(ROOT / "scripts" / "synthetic_corrector.py"), "--out-dir", str(self.synthetic_dir()),
               *self.budget.synthetic]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)

    def metrics_of(self, run: Run) -> Optional[dict]:
        """A finished run's metrics, from its folder or from its evidence; None when it has not finished."""
        return run.metrics() if self.evidence is None else evidence.load_metrics(self.evidence, self.runs, run.out)

    def found(self, runs: list[Run]) -> list[dict]:
        return [m for m in map(self.metrics_of, runs) if m is not None]

    def every_run(self) -> list[Run]:
        return list({run.out: run for name in SECTIONS for run in self.section(name)}.values())  # each folder once

    def collect(self) -> dict:
        """Metrics of every finished run, every section (missing runs are left out)."""
        found = self.found
        synthetic = self.synthetic_dir() / "results.json"
        return {
            "run_seconds": sum(m.get("wall_seconds", 0.0) for m in found(self.every_run())),
            "pretrain": self.metrics_of(self.pretrain()),
            "table1": {i: {s: found([self.table1(i, s, seed) for seed in self.seeds]) for s in TABLE1} for i in INITS},
            "table3": {s: found([self.table3(s, seed) for seed in self.seeds]) for s in TABLE3},
            "table3_lm": {s: found([self.table3_lm(s, seed) for seed in self.seeds]) for s in TABLE3_LM},
            "ablation": {h: found([self.ablation(h, seed) for seed in self.seeds]) for h in self.hidden},
            "synthetic": read_json(synthetic) if synthetic.is_file() else None,
            "dynnibal": {"runs": {i: {r: found([self.dynnibal_run(i, r, seed) for seed in self.seeds])
                                      for r in dynnibal.ROWS} for i in dynnibal.INITS},
                         "passages": self.budget.dynnibal_world[0], "snm_targets": self.dynnibal_snm_targets(),
                         "world": "described, {} passages, toy_seed {}".format(*self.budget.dynnibal_world)},
            "generative": self.collect_generative(),
            "described": {"tuned": described.world_name(*self.budget.described_worlds[0]),
                          "worlds": {described.world_name(*w): {i: {r: found([self.described_run(w, i, r, seed)
                                                                             for seed in self.seeds])
                                                                     for r in described.ROWS}
                                                                 for i in described.INITS}
                                     for w in self.budget.described_worlds}},
            "corrector_regime": {"worlds": {described.world_name(*w): self.corrector_regime_rows(w)
                                            for w in self.budget.corrector_regime_worlds}},
            "corrector_refresh": {"worlds": {described.world_name(*w): self.corrector_refresh_rows(w)
                                             for w in self.budget.corrector_regime_worlds}},
        }

    def complete_seeds(self, runs: dict[str, Callable[[int], Run]]) -> dict[str, list[dict]]:
        """Each row's runs (`runs[row](seed)`) in seed order, from the seeds whose every row has finished: a seed part
        way through would pair its finished rows with other seeds' in the means."""
        by_seed = [{row: self.metrics_of(run(seed)) for row, run in runs.items()} for seed in self.seeds]
        complete = [rows for rows in by_seed if all(m is not None for m in rows.values())]
        return {row: [rows[row] for rows in complete] for row in runs}

    def corrector_regime_rows(self, world: tuple[int, int]) -> dict[str, list[dict]]:
        """The section's rows on `world`, from the seeds whose every row has finished."""
        return self.complete_seeds({row: functools.partial(self.corrector_regime_run, world, row)
                                    for row in corrector_regime.ROWS})

    def corrector_refresh_rows(self, world: tuple[int, int]) -> dict[str, list[dict]]:
        """The section's rows and the corrector_regime rows its curve reuses, from the seeds where all of them
        finished."""
        return self.complete_seeds(
            {**{row: functools.partial(self.corrector_regime_run, world, row) for row in corrector_refresh.REUSED},
             **{row: functools.partial(self.corrector_refresh_run, world, row) for row in corrector_refresh.ROWS}})

    def splits_manifest(self) -> Optional[dict]:
        if self.evidence is not None:
            path = self.evidence / SPLITS_EVIDENCE
            return read_json(path) if path.is_file() else None
        manifest = self.generative_splits() / "manifest.json"
        return read_json(manifest) if manifest.is_file() else None

    def dense_titles(self, seed: int) -> Optional[dict]:
        out = self.generative_dense(seed).out
        if self.evidence is None:
            return generative.dense_titles(out)
        return evidence.load_title_metrics(self.evidence, self.runs, out)

    def collect_generative(self) -> dict:
        found = self.found
        return {
            "world": "{} passages, toy_seed {}".format(*self.budget.generative_world),
            "splits": self.splits_manifest(),
            "main": {v: found([self.generative_run(v, s) for s in self.seeds]) for v in generative.VARIANTS},
            "fractions": {f: {v: found([self.generative_run(v, s, fraction=f) for s in self.seeds])
                              for v in generative.COMPARED} for f in FRACTIONS},
            "sizes": {size: {v: found([self.generative_run(v, s, size=size) for s in self.seeds])
                             for v in generative.COMPARED} for size in generative.SIZES},
            "bridge": {v: found([self.generative_run(v, s, bridge=True) for s in self.seeds])
                       for v in generative.COMPARED},
            "dense": [m for m in map(self.dense_titles, self.seeds) if m],
        }

    def write_evidence(self, folder: Path, meta: dict) -> int:
        """Every finished run's summary, the splits' manifest and the report's `meta` under `folder` (after collect,
        which computes the dual encoders' title metrics); returns how many runs had finished."""
        names = evidence.Placeholders(self.runs, ROOT)
        written = 0
        for run in self.every_run():
            summary = evidence.summary(run.script, run.config, run.out, run.overrides, names)
            if summary is not None:
                atomic_write_json(evidence.evidence_path(folder, self.runs, run.out), summary)
                written += 1
        manifest = self.splits_manifest()
        if manifest is not None:
            atomic_write_json(folder / SPLITS_EVIDENCE, names.value(manifest))
        atomic_write_json(folder / evidence.META, meta)  # as given: the report names its runs folder
        return written

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

"""The run every recipe trains in: the Accelerate run (seeding, run directory, trackers), atomic checksummed
checkpoints with resume, the cross-process agreement check, input-fault release, and metrics files. One step's
machinery (data order, the optimizer step and its fault guard) is `train.step`; the one module each recipe trains
lives in `train.trainable`.

Long file: checkpointing, resume, the stop signal and the metrics files all read and write the same run state
(its directory, lock, Accelerator, guard counters, history and corpus passes); split, each part would reach into
the others' fields."""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import shutil
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from accelerate.utils import id_tensor_storage, set_seed

from rag_train.buffer.embed import CorpusPasses
from rag_train.config import ConfigError, flatten, save_config, to_yaml
from rag_train.io import (
    CorruptFileError,
    StorageError,
    atomic_write_json,
    errno_of,
    folder_checksums,
    free_space,
    fsync_tree,
    read_json,
    remove_stale_temporaries,
    sha256_file,
    size_text,
    state_bytes,
    tree_size,
    usual_modes,
    verify_checksums,
    write_fault,
    write_step,
)
from rag_train.launch import make_accelerator
from rag_train.preemption import Preempted, StopSignal, raised_by_every_process
from rag_train.train.curves import STRATEGY_PLOT, plot_strategy_log
from rag_train.train.run_dir import (
    CHECKPOINTS,
    CONFIG_FILE,
    CORPUS_RECORD,
    LOGS,
    RUN_OUTPUTS,
    claim_directory,
    lock_run_directory,
    remove_previous_run,
)
from rag_train.train.step import NonFiniteGuard
from rag_train.train.trainable import check_deepspeed_config

LATEST = "latest.json"  # informative pointer; the newest complete step-* folder is what resumes
STEP_FILE = "step.json"
CHECKSUMS = "checksums.json"  # sha256 + size of every other file of a checkpoint, written last
TRAINER_STATE = "trainer_state.json"  # fault counters (NonFiniteGuard) and the evaluation history


class TrainingRun:
    """A run directory plus its Accelerator: config saved, trackers started, checkpoints kept atomic and
    checksummed, processes checked to agree before any long work."""

    def __init__(self, cfg: Any, project: str, find_unused_parameters: bool = False):
        self.cfg = cfg
        self.dir = Path(cfg.train.output_dir)
        self.accelerator = make_accelerator(
            mixed_precision=cfg.train.mixed_precision, log_with=cfg.train.tracker, project_dir=str(self.dir / LOGS),
            timeout_s=cfg.train.collective_timeout, find_unused_parameters=find_unused_parameters,
            threads=cfg.train.cpu_threads)
        world = self.accelerator.num_processes
        if cfg.train.batch_size % world:
            raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be divisible by the {world} processes")
        check_deepspeed_config(self.accelerator)
        resolved = to_yaml(cfg)
        self.agree(config=hashlib.sha256(resolved.encode()).hexdigest())
        set_seed(cfg.train.seed, device_specific=False)
        self.guard = NonFiniteGuard(cfg.train.max_bad_steps)  # the recipe sets aux_max_loss from its strategy
        self.history: list[dict] = []  # evaluations during training; checkpointed, so resuming keeps it
        self.totals: dict[str, list] = {}  # per-step values / records a recipe reports at the end; checkpointed too
        self.model: Optional[torch.nn.Module] = None  # the prepared module (`prepare`)
        self.resumed_from: Optional[Path] = None  # the checkpoint `resume` loaded: saving its step again is a no-op
        self.passes = CorpusPasses(self.accelerator.print)  # whole-corpus embedding passes, for metrics.json
        self.registered = ExitStack()  # what the run registers for its lifetime (its token cache), undone at close
        self.started = time.time()
        self.accelerator.register_save_state_pre_hook(drop_tied_aliases)
        claim_directory(cfg, self.dir)  # every process reads; nothing is written before all of them have looked
        # what was there before this run, so that a run stopped by bad input can take back what it wrote (`release`)
        self.fresh = cfg.train.overwrite or not any((self.dir / name).exists() for name in RUN_OUTPUTS)
        self.made = {name: not (self.dir / name).exists() for name in (".", LOGS, CORPUS_RECORD)}
        self.accelerator.wait_for_everyone()  # every process has looked before the lock may create the directory
        self.lock = lock_run_directory(self.dir, f"training ({project})", self.accelerator)
        self.stop_signal = StopSignal()
        self.saved: Optional[Path] = None  # the checkpoint this process last wrote
        _OPENED.append(self)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            if cfg.train.overwrite:
                remove_previous_run(self.dir)
            self._tidy_checkpoints()
            with write_step("creating the run directory", self.dir):
                self.dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.dir / CONFIG_FILE, resolved)
        self.accelerator.wait_for_everyone()
        if cfg.train.tracker:
            self.accelerator.init_trackers(project, config=_flat_config(cfg))

    def release(self) -> None:
        """After a stop on bad input (`releases_on_input_fault`): a run that started in a directory holding no run
        and wrote nothing worth keeping (its only run output is the config.yaml it wrote) takes back config.yaml,
        corpus.json and logs/, and the directory if it made it, so the corrected command runs in the same folder
        instead of being refused as another run. Anything else (a buffer, checkpoints, warm starts) is kept."""
        self.close()
        if not self.fresh or not self.accelerator.is_main_process or not self.dir.is_dir():
            return
        if [name for name in RUN_OUTPUTS if (self.dir / name).exists()] != [CONFIG_FILE]:
            return
        (self.dir / CONFIG_FILE).unlink()
        if self.made[CORPUS_RECORD]:
            (self.dir / CORPUS_RECORD).unlink(missing_ok=True)
        if self.made[LOGS]:
            shutil.rmtree(self.dir / LOGS, ignore_errors=True)
        remove_stale_temporaries(self.dir)
        if self.made["."] and not any(self.dir.iterdir()):
            self.dir.rmdir()

    # -- agreement between processes ----------------------------------------------------------------

    def agree(self, **items: Optional[str]) -> None:
        """Every process must hold the same value for each item (config hash, corpus fingerprint, buffer
        manifest hash, ...): ConfigError on all of them naming the item and the ranks that differ, before any
        long work. A no-op with one process."""
        if self.accelerator.num_processes == 1:
            return
        from accelerate.utils import gather_object

        everyone = gather_object([items])
        for key, value in items.items():
            values = [theirs.get(key) for theirs in everyone]
            if len(set(values)) > 1:
                differ = [rank for rank, v in enumerate(values) if v != values[0]]
                shown = ", ".join(f"rank {r}: {str(v)[:16]}" for r, v in enumerate(values))
                raise raised_by_every_process(ConfigError(
                    f"processes disagree on the {key.replace('_', ' ')} "
                    f"(rank(s) {differ} differ from rank 0; {shown}); "
                    "every process must run the same config on the same corpus and buffer. Nothing was trained."))

    def check_corpus(self, corpus: Any) -> None:
        """Before long work: the config fits this corpus (no k larger than it), and every process has it."""
        rows = len(corpus)
        limits = self.cfg.strategy.corpus_limits()  # declared by the strategy's config
        if getattr(self.cfg.eval, "num_passages", None):
            limits.append(("eval.num_passages", self.cfg.eval.num_passages))
        for key, value in limits:
            if value > rows:
                raise ConfigError(f"{key}={value} is larger than the corpus {corpus.path} ({rows} passages)")
        self.agree(corpus_fingerprint=corpus.fingerprint)
        if self.accelerator.is_main_process:
            self._record_corpus(corpus)

    def _record_corpus(self, corpus: Any) -> None:
        """`<run>/corpus.json`: the corpus export / evaluate must use. A resumed run must keep its corpus."""
        from rag_train.train.run_corpus import RECORD, record_corpus, recorded_corpus

        before = recorded_corpus(self.dir) if (self.dir / RECORD).is_file() else None
        if before and self.latest_checkpoint() is not None and before["fingerprint"] != corpus.fingerprint:
            raise ConfigError(f"{self.dir / RECORD}: this run trained on {before['path']} (fingerprint "
                              f"{before['fingerprint'][:12]}); resuming it on {corpus.path} (fingerprint "
                              f"{corpus.fingerprint[:12]}) would mix two corpora. Point data.* back at it.")
        record_corpus(self.dir, corpus)

    def check_buffer(self, directory: Path) -> None:
        """Every process sees the same buffer manifest (hash of its bytes)."""
        from rag_train.buffer.store import MANIFEST

        self.agree(buffer_manifest=sha256_file(Path(directory) / MANIFEST))

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple:
        """`accelerator.prepare` of the run's one trained module (a `Trainable`), its optimizer and scheduler.
        Under DeepSpeed the engine takes its batch sizes and gradient clipping from this config:
        `train.batch_size` is the global batch (1/N per process, no gradient accumulation) and
        `train.max_grad_norm` the clipping norm (0: none), whatever the accelerate config says."""
        plugin = self.accelerator.state.deepspeed_plugin
        if plugin is not None:
            world = self.accelerator.num_processes
            plugin.deepspeed_config.update(
                train_micro_batch_size_per_gpu=self.cfg.train.batch_size // world,
                train_batch_size=self.cfg.train.batch_size, gradient_accumulation_steps=1,
                gradient_clipping=float(self.cfg.train.max_grad_norm))
        prepared = self.accelerator.prepare(model, optimizer, scheduler)
        self.model = prepared[0]
        return prepared

    # -- checkpoints -------------------------------------------------------------------------------

    def _tidy_checkpoints(self) -> None:
        """Main process, at start: finish what a kill interrupted. A `.old-step-*` folder whose replacement
        never arrived is put back; temporary folders of unfinished saves and temporary files are removed."""
        root = self.dir / CHECKPOINTS
        if not root.is_dir():
            remove_stale_temporaries(self.dir, recursive=True)  # a killed buffer build's, evaluation's, save's
            return
        for old in root.glob(".old-step-*"):
            final = root / old.name[len(".old-"):]
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, final)
        for tmp in root.glob(".tmp-step-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        remove_stale_temporaries(self.dir, recursive=True)  # e.g. `.latest.json.*.tmp` of a write a kill interrupted

    def stop_if_signalled(self, step: int, extra: Optional[Callable[[Path], None]] = None) -> None:
        """After each training step: did any process get a stop signal? (One small all-reduce, so every process
        stops after the same step.) If so, checkpoint this step (unless it was just saved) and raise Preempted."""
        if not self.stop_signal.agreed(self.accelerator):
            return
        just_saved = self.saved is not None and self.saved.name == f"step-{step:08d}"
        path = self.saved if just_saved else self.save(step, extra)
        raise Preempted(f"stopped by {self.stop_signal.by()} after step {step}: checkpoint {path} written; "
                        "train.resume=true continues from it")

    def checkpoints(self) -> list[Path]:
        """Finished checkpoints, oldest first. A folder only gets its `step-*` name once complete (it is
        written as `.tmp-step-*` and renamed), so the names alone are enough: `latest.json` is informative."""
        root = self.dir / CHECKPOINTS
        found = [p for p in root.glob("step-*") if p.is_dir() and (p / STEP_FILE).is_file()] if root.is_dir() else []
        return sorted(found, key=lambda p: p.name)

    def latest_checkpoint(self) -> Optional[Path]:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, extra: Optional[Callable[[Path], None]] = None) -> Path:
        """accelerator.save_state (+ `extra(folder)` on every process, e.g. the strategy's state, + the fault
        counters) into a temporary folder; the main process then writes `checksums.json` (sha256 and size of
        every file), fsyncs, and renames the folder into place. A kill at any moment leaves the previous
        checkpoint intact and never a `step-*` folder that is not complete. The checkpoint a resumed run loaded
        already holds this step's state: it is not written again (a run resumed after its final checkpoint)."""
        root = self.dir / CHECKPOINTS
        final = root / f"step-{step:08d}"
        if final == self.resumed_from and final.is_dir():
            if self.accelerator.is_main_process and self._latest_name() != final.name:  # a kill left it behind
                atomic_write_json(root / LATEST, {"name": final.name, "step": step})
            self.accelerator.wait_for_everyone()
            return final
        tmp = root / f".tmp-step-{step:08d}"
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        with self._write_failure(final, tmp):
            self.accelerator.save_state(str(tmp))
            if extra is not None:
                extra(tmp)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            with self._write_failure(final, tmp):
                atomic_write_json(tmp / TRAINER_STATE, {"guard": self.guard.state_dict(), "history": self.history,
                                                        "totals": self.totals, "corpus_passes": self.passes.records})
                atomic_write_json(tmp / STEP_FILE, {"step": step})
                atomic_write_json(tmp / CHECKSUMS, {"step": step, "files": folder_checksums(tmp, exclude=(CHECKSUMS,))})
                usual_modes(tmp)  # safetensors writes 0600 files
                fsync_tree(tmp)
            old = root / f".old-{final.name}"
            if final.exists():  # re-saving a step (a resumed run that had finished): swap, never delete first
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            atomic_write_json(root / LATEST, {"name": final.name, "step": step})
            keep = self.cfg.train.keep_checkpoints  # 0: every one
            for stale in self.checkpoints()[:-keep] if keep else []:
                shutil.rmtree(stale, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.saved = final
        return final

    def _latest_name(self) -> Optional[str]:
        """The checkpoint `latest.json` names (None when it is missing or unreadable)."""
        try:
            return read_json(self.dir / CHECKPOINTS / LATEST).get("name")
        except CorruptFileError:
            return None

    @contextmanager
    def _write_failure(self, final: Path, tmp: Path) -> Iterator[None]:
        """A write into checkpoint folder `tmp` that fails for lack of space or permission (a full disk or quota
        surfaces from torch as `RuntimeError: [enforce fail at inline_container.cc]`, from safetensors as
        `SafetensorError ... (os error 28)`) becomes a StorageError naming the folder, the space a checkpoint
        needs (the previous one's size, else the trained weights and optimizer state), the filesystem and its free
        space; the half-written folder is removed, the previous checkpoint is left as it was."""
        try:
            yield
        except Exception as exc:
            if not write_fault(exc):
                raise
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            previous = self.latest_checkpoint()
            needed = tree_size(previous) if previous is not None else (
                3 * state_bytes(self.model) if self.model is not None else None)
            place, free = free_space(self.dir)
            shutil.rmtree(tmp, ignore_errors=True)
            if write_fault(exc) == "permission":
                why = f"not writable: {place} is on a read-only filesystem or this user may not write there"
            else:
                why = (f"it needs about {size_text(needed)}, {free / 2**20 if free is not None else float('nan'):.1f} "
                       f"MiB are free on the filesystem of {self.dir} (a full disk or quota is the usual cause)")
            kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
            error = StorageError(
                f"writing checkpoint {final.name} into {tmp} failed: {text[:300]}. {why[0].upper() + why[1:]}. The "
                f"unfinished folder was removed; {kept} "
                "(free space, then train.resume=true).")
            error.errno = errno_of(exc) or (errno.ENOSPC if write_fault(exc) == "space" else errno.EACCES)
            raise error from exc

    def verify_checkpoint(self, path: Path) -> None:
        """CorruptFileError naming the first file of checkpoint `path` that is missing, truncated or altered."""
        record = path / CHECKSUMS
        try:
            if not record.is_file():  # every checkpoint gets one before its folder takes its step-* name
                raise CorruptFileError(f"{record} is missing")
            verify_checksums(path, read_json(record)["files"], record)
        except CorruptFileError as exc:
            older = [p.name for p in self.checkpoints() if p != path]
            hint = (f"move {path} aside to resume from {older[-1]}" if older
                    else "no older checkpoint is left; restart without train.resume")
            raise CorruptFileError(f"checkpoint {path.name} is damaged: {exc}. Nothing was loaded; {hint}.") from None

    def resume(self) -> int:
        """Restore the latest checkpoint (models, optimizer, scheduler, registered objects, RNG, fault
        counters) after checking its checksums; 0 if none."""
        if not self.cfg.train.resume:
            return 0
        path = self.latest_checkpoint()
        if path is None:
            self.accelerator.print(f"train.resume=true but {self.dir} has no checkpoint yet: starting at step 0")
            return 0
        self.verify_checkpoint(path)
        self.accelerator.load_state(str(path))
        self.resumed_from = path
        state = read_json(path / TRAINER_STATE)
        self.guard.load_state_dict(state["guard"])
        self.history[:] = state["history"]
        for key, values in state["totals"].items():
            self.totals.setdefault(key, [])[:] = values
        # the corpus passes made before the checkpoint, then those this process made before loading it (a resumed
        # buffer build, the warm start's recall): metrics.json lists every pass the run is known to have made
        self.passes.records[:0] = state.get("corpus_passes", [])
        step = int(read_json(path / STEP_FILE)["step"])
        self.guard.calls = step
        self.accelerator.print(f"resumed from {path} at step {step}")
        return step

    # -- logging -----------------------------------------------------------------------------------

    def log(self, values: dict[str, float], step: int) -> None:
        if self.cfg.train.tracker:
            self.accelerator.log(values, step=step)

    def record_strategy_values(self, step: int, values: dict[str, float]) -> None:
        """The strategy's values at a logged step (`Strategy.logged_values`, e.g. the corrector's drift), kept for
        metrics.json's `strategy_log`; checkpointed with the totals, so a resumed run keeps the earlier steps."""
        if values:
            for key, value in {"step": step, **values}.items():
                self.totals.setdefault(f"strategy_log/{key}", []).append(value)

    def strategy_log(self) -> dict[str, list]:
        """{value: [one per logged step], "step": [...]}: the curves of `record_strategy_values`."""
        return {k.removeprefix("strategy_log/"): v for k, v in self.totals.items() if k.startswith("strategy_log/")}

    def write_metrics(self, metrics: dict) -> None:
        """metrics.json (atomically), the marker of a finished run, after the figure of its `strategy_log` (when the
        strategy logged values). Adds the fault counters and the wall time to `metrics` (in place, so the recipe
        returns what was written)."""
        metrics.update(self.guard.counts(), wall_seconds=round(time.time() - self.started, 2),
                       corpus_passes=self.passes.records)
        if self.accelerator.is_main_process:
            if metrics.get("strategy_log"):
                plot_strategy_log(metrics["strategy_log"], self.dir / STRATEGY_PLOT)
            atomic_write_json(self.dir / "metrics.json", metrics)

    def end(self) -> None:
        """Finish the trackers and give the directory back (`close`). Not `accelerator.end_training()`: that also
        destroys the process group, and a recipe may run inside another (the RLM's retriever warm start); entry
        scripts destroy it at exit."""
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self.close()

    def close(self) -> None:
        """Release the directory's lock, the stop signals and what the run registered; safe to call again."""
        self.stop_signal.restore()
        self.registered.close()
        if self.lock is not None:
            self.lock.release()


def drop_tied_aliases(models: list, weights: list[dict], output_dir: str) -> None:
    """`save_state` hook: keep one name per tied tensor (T5's shared embedding is also each stack's
    `embed_tokens` and the `lm_head`), the first in the state dict, as transformers' `save_pretrained` does.
    accelerate would drop the same names itself, but logs "Removed shared tensor ... This should be OK" on
    every checkpoint; loading (safetensors `load_model`) fills the aliases back in through the tie."""
    for state in weights:
        kept: set = set()
        for name in list(state):
            tensor = state[name]
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = id_tensor_storage(tensor)
            if storage in kept:
                del state[name]
            else:
                kept.add(storage)


_OPENED: list[TrainingRun] = []  # runs opened by the recipe calls in progress (`releases_on_input_fault`)


def releases_on_input_fault(recipe: Callable) -> Callable:
    """Decorator for a recipe's entry function: when it stops on bad input (what entry scripts exit 2 for: config,
    data, buffer, checkpoint, model path), the runs it opened `release` what they wrote if that is nothing worth
    keeping, so a corrected rerun into the same folder is not refused. Any other stop leaves the run as it is."""
    @functools.wraps(recipe)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mark = len(_OPENED)
        try:
            return recipe(*args, **kwargs)
        except Exception as exc:
            if is_input_fault(exc):
                for run in reversed(_OPENED[mark:]):
                    run.release()
            raise
        finally:
            for run in reversed(_OPENED[mark:]):
                run.close()
            del _OPENED[mark:]

    return wrapped


def is_input_fault(exc: BaseException) -> bool:
    """A fault of the input (exit status 2 in the entry scripts), not of the machine or the numbers."""
    from rag_train.buffer.store import BufferError
    from rag_train.data.errors import DataError
    from rag_train.models.reader import ReaderLoadError

    return isinstance(exc, (ConfigError, DataError, BufferError, CorruptFileError, ReaderLoadError))


def steps_per_second(first_step: int, last_step: int, seconds: float) -> Optional[float]:
    """The training steps this process ran per second of training, for metrics.json (None where it ran none: a
    finished run resumed)."""
    return (last_step - first_step) / seconds if last_step > first_step else None


def flat_metrics(entry: dict) -> dict[str, float]:
    """Evaluation results as tracker scalars, for every recipe:
    {"nq": {"recall": {"5": .4}}} -> {"eval/nq/recall@5": .4}."""
    out = {}
    for name, values in entry.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if isinstance(value, dict):
                out.update({f"eval/{name}/{key}@{k}": v for k, v in value.items()})
            elif isinstance(value, (int, float)):
                out[f"eval/{name}/{key}"] = value
    return out


def _flat_config(cfg: Any) -> dict[str, Any]:
    """Trackers take flat scalars: `section.key` -> value, anything but a scalar as its text."""
    from omegaconf import OmegaConf

    return {key: "None" if value is None else value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in flatten(OmegaConf.to_container(OmegaConf.structured(cfg))).items()}


def save_pretrained_atomic(directory: Path, *objects: Any) -> None:
    """`save_pretrained` of each object (model, tokenizer) into one folder, written beside and swapped in, with the
    checksums of its files (`checksums.json`), which every loader checks (`verify_model_files`)."""
    from rag_train.io import atomic_directory, record_model_files, state_bytes

    needed = state_bytes(*(obj for obj in objects if isinstance(obj, torch.nn.Module))) + 2**20
    with atomic_directory(directory, "saving", needed=needed) as tmp:
        for obj in objects:
            obj.save_pretrained(str(tmp))
        record_model_files(tmp)

"""What both recipes share: the Accelerate run (seeding, run directory, trackers), step-indexed data order,
atomic checksummed checkpoints with resume, the cross-process agreement check, the numerical-fault guard,
the optimizer step, and metrics files. The one module each recipe trains lives in `train.trainable`.

Data order is a pure function of (seed, step): the global batch for step t is the same whatever the number
of processes, each process takes its contiguous slice of it, and resuming needs nothing but the step.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import math
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import id_tensor_storage, set_seed

from rag_train.buffer.embed import CorpusPasses
from rag_train.config import ConfigError, save_config, to_yaml
from rag_train.io import (CorruptFileError, StorageError, atomic_write_json, errno_of, folder_checksums, free_space,
                          fsync_tree, read_json, remove_stale_temporaries, sha256_file, size_text, state_bytes,
                          tree_size, usual_modes, verify_checksums, write_fault, write_step)
from rag_train.launch import make_accelerator
from rag_train.train.run_dir import (CHECKPOINTS, CONFIG_FILE, CORPUS_RECORD, LOGS, RUN_OUTPUTS, claim_directory,
                                    remove_previous_run)
from rag_train.train.trainable import check_deepspeed_config, deepspeed_stage

LATEST = "latest.json"  # informative pointer; the newest complete step-* folder is what resumes
STEP_FILE = "step.json"
CHECKSUMS = "checksums.json"  # sha256 + size of every other file of a checkpoint, written last
TRAINER_STATE = "trainer_state.json"  # fault counters (NonFiniteGuard) and the evaluation history


def seed_stage(seed: int, stage: str) -> None:
    """Seed python, numpy and torch (every device) for one stage of a recipe from (train.seed, stage name). Each
    stage starts from its own seed, so its random draws (initial weights, dropout, sampling) are the same
    whether the stages before it ran in this process or were reused from disk after a kill."""
    digest = hashlib.sha256(f"{seed}:{stage}".encode()).digest()
    set_seed(int.from_bytes(digest[:4], "little") % 2**31, device_specific=False)


def global_batch(num_examples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Example indices of the global batch at `step`: epochs are seeded permutations, walked in order."""
    start = step * batch_size
    out = np.empty(batch_size, dtype=np.int64)
    filled = 0
    while filled < batch_size:
        epoch, offset = divmod(start + filled, num_examples)
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        take = min(batch_size - filled, num_examples - offset)
        out[filled : filled + take] = order[offset : offset + take]
        filled += take
    return out


def local_slice(items: np.ndarray, accelerator: Accelerator) -> np.ndarray:
    """This process's contiguous share of a global batch (sizes checked in `TrainingRun`)."""
    per_rank = len(items) // accelerator.num_processes
    return items[accelerator.process_index * per_rank : (accelerator.process_index + 1) * per_rank]


class NonFiniteGuard:
    """Numerical-fault bookkeeping for `optimizer_step`.

    A step whose task loss or encoder gradient is not finite (on any process) is skipped whole: no
    parameter, optimizer or scheduler update. A step whose auxiliary (corrector) loss or gradient is not
    finite, or whose auxiliary loss exceeds `aux_max_loss` (> 0), keeps its encoder update and drops only
    the corrector's. Both are counted, printed, logged as `skipped_steps` / `corrector_skipped_steps` and
    written into metrics.json; `max_in_a_row` such steps in a row stop the run with FloatingPointError.
    The counts are checkpointed, so a resumed run reports what an uninterrupted one would.
    """

    def __init__(self, max_in_a_row: int, aux_max_loss: float = 0.0):
        self.max_in_a_row = max_in_a_row
        self.aux_max_loss = aux_max_loss
        self.in_a_row = 0
        self.skipped = 0
        self.aux_in_a_row = 0
        self.aux_skipped = 0
        self.calls = 0  # optimizer steps attempted (= the training step after it)

    def record(self, accelerator: Accelerator, bad: bool, aux_bad: bool, why: str) -> None:
        """Count one step's outcome (decided identically on every process); raise after too many in a row."""
        self.calls += 1
        if bad:
            self.in_a_row += 1
            self.skipped += 1
            accelerator.print(f"warning: step {self.calls}: {why}; step skipped ({self.in_a_row} in a row, "
                              f"{self.skipped} in all)")
            if self.in_a_row >= self.max_in_a_row:
                raise FloatingPointError(
                    f"{self.in_a_row} consecutive steps had a non-finite loss or gradient; stopping at step "
                    f"{self.calls} (train.max_bad_steps={self.max_in_a_row}). Lower train.lr or check the data; "
                    "the last checkpoint is intact (train.resume=true continues from it).")
            return
        self.in_a_row = 0
        if aux_bad:
            self.aux_in_a_row += 1
            self.aux_skipped += 1
            accelerator.print(f"warning: step {self.calls}: {why}; corrector update skipped, encoder updated "
                              f"({self.aux_in_a_row} in a row, {self.aux_skipped} in all)")
            if self.aux_in_a_row >= self.max_in_a_row:
                raise FloatingPointError(
                    f"the corrector diverged {self.aux_in_a_row} steps in a row; stopping at step {self.calls} "
                    f"(train.max_bad_steps={self.max_in_a_row}). Lower strategy.corrector.lr or "
                    "strategy.corrector.weight; the last checkpoint is intact.")
        else:
            self.aux_in_a_row = 0

    def counts(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped, "corrector_skipped_steps": self.aux_skipped}

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped, "aux_in_a_row": self.aux_in_a_row,
                "aux_skipped": self.aux_skipped, "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.skipped = int(state["in_a_row"]), int(state["skipped"])
        self.aux_in_a_row, self.aux_skipped = int(state["aux_in_a_row"]), int(state["aux_skipped"])
        self.calls = int(state["calls"])


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
        self.agree(config=hashlib.sha256(to_yaml(cfg).encode()).hexdigest())
        set_seed(cfg.train.seed, device_specific=False)
        self.guard = NonFiniteGuard(cfg.train.max_bad_steps)  # the recipe sets aux_max_loss from its strategy
        self.history: list[dict] = []  # evaluations during training; checkpointed, so resuming keeps it
        self.totals: dict[str, list] = {}  # per-step values / records a recipe reports at the end; checkpointed too
        self.model: Optional[torch.nn.Module] = None  # the prepared module (`prepare`)
        self.passes = CorpusPasses(self.accelerator.print)  # whole-corpus embedding passes, for metrics.json
        self.started = time.time()
        self.accelerator.register_save_state_pre_hook(drop_tied_aliases)
        claim_directory(cfg, self.dir)  # every process reads; nothing is written before all of them have looked
        # what was there before this run, so that a run stopped by bad input can take back what it wrote (`release`)
        self.fresh = cfg.train.overwrite or not any((self.dir / name).exists() for name in RUN_OUTPUTS)
        self.made = {name: not (self.dir / name).exists() for name in (".", LOGS, CORPUS_RECORD)}
        _OPENED.append(self)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            if cfg.train.overwrite:
                remove_previous_run(self.dir)
            self._tidy_checkpoints()
            with write_step("creating the run directory", self.dir):
                self.dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.dir / CONFIG_FILE)
        self.accelerator.wait_for_everyone()
        if cfg.train.tracker:
            self.accelerator.init_trackers(project, config=_flat_config(cfg))

    def release(self) -> None:
        """After a stop on bad input (`releases_on_input_fault`): a run that started in a directory holding no run
        and wrote nothing worth keeping (its only run output is the config.yaml it wrote) takes back config.yaml,
        corpus.json and logs/, and the directory if it made it, so the corrected command runs in the same folder
        instead of being refused as another run. Anything else (a buffer, checkpoints, warm starts) is kept."""
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
                raise ConfigError(
                    f"processes disagree on the {key.replace('_', ' ')} (rank(s) {differ} differ from rank 0; {shown}); "
                    "every process must run the same config on the same corpus and buffer. Nothing was trained.")

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

    def checkpoints(self) -> list[Path]:
        """Finished checkpoints, oldest first. A folder only gets its `step-*` name once complete (it is
        written as `.tmp-step-*` and renamed), so the names alone are enough: `latest.json` is informative."""
        root = self.dir / CHECKPOINTS
        found = [p for p in root.glob("step-*") if p.is_dir() and (p / STEP_FILE).is_file()] if root.is_dir() else []
        return sorted(found, key=lambda p: p.name)

    def latest_checkpoint(self) -> Optional[Path]:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, extra: Optional[Callable[[Path], None]] = None, keep: int = 2) -> Path:
        """accelerator.save_state (+ `extra(folder)` on every process, e.g. the strategy's state, + the fault
        counters) into a temporary folder; the main process then writes `checksums.json` (sha256 and size of
        every file), fsyncs, and renames the folder into place. A kill at any moment leaves the previous
        checkpoint intact and never a `step-*` folder that is not complete."""
        root = self.dir / CHECKPOINTS
        final = root / f"step-{step:08d}"
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
            for stale in self.checkpoints()[:-keep]:
                shutil.rmtree(stale, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return final

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
            error = StorageError(
                f"writing checkpoint {final.name} into {tmp} failed: {text[:300]}. {why[0].upper() + why[1:]}. The "
                f"unfinished folder was removed; {'the previous checkpoint ' + str(previous) + ' is intact' if previous else 'no earlier checkpoint exists'} "
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

    def write_metrics(self, metrics: dict) -> None:
        """metrics.json (atomically), the marker of a finished run. Adds the fault counters and the wall time to
        `metrics` (in place, so the recipe returns what was written)."""
        metrics.update(self.guard.counts(), wall_seconds=round(time.time() - self.started, 2),
                       corpus_passes=self.passes.records)
        if self.accelerator.is_main_process:
            atomic_write_json(self.dir / "metrics.json", metrics)

    def end(self) -> None:
        """Finish the trackers. Not `accelerator.end_training()`: that also destroys the process group, and a
        recipe may run inside another (the RLM's retriever warm start); entry scripts destroy it at exit."""
        for tracker in self.accelerator.trackers:
            tracker.finish()


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
            del _OPENED[mark:]

    return wrapped


def is_input_fault(exc: BaseException) -> bool:
    """A fault of the input (exit status 2 in the entry scripts), not of the machine or the numbers."""
    from rag_train.buffer.store import BufferError
    from rag_train.data.errors import DataError
    from rag_train.models.reader import ReaderLoadError

    return isinstance(exc, (ConfigError, DataError, BufferError, CorruptFileError, ReaderLoadError))


def _flat_config(cfg: Any) -> dict[str, Any]:
    """Trackers take flat scalars; nested sections become `section.key`."""
    from omegaconf import OmegaConf

    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        elif isinstance(node, (int, float, str, bool)) or node is None:
            flat[prefix] = "None" if node is None else node
        else:
            flat[prefix] = str(node)

    walk("", OmegaConf.to_container(OmegaConf.structured(cfg)))
    return flat


# -- the one trained module, and DeepSpeed ZeRO ------------------------------------------------------------


def _finite_norm(params: list, max_norm: float, accelerator: Accelerator) -> torch.Tensor:
    """Gradient norm of `params` (clipped to `max_norm` when > 0); non-finite if any gradient is."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if max_norm > 0:
        norm = accelerator.clip_grad_norm_(grads, max_norm)
        return torch.zeros(()) if norm is None else torch.as_tensor(norm).detach().float().cpu()  # None: DeepSpeed
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.detach().float())
                                                 for p in grads])).cpu()


def auxiliary_params(optimizer) -> list:
    """Parameters of the optimizer groups a strategy marked `auxiliary` (the corrector's)."""
    return [p for group in optimizer.param_groups if group.get("auxiliary") for p in group["params"]]


def optimizer_step(accelerator: Accelerator, loss: torch.Tensor, params: list, optimizer, scheduler,
                   guard: NonFiniteGuard, max_grad_norm: float, aux: Optional[torch.Tensor] = None,
                   backward: bool = True, on_gradients: Optional[Callable[[], None]] = None) -> bool:
    """Backward of `loss` (+ `aux`), clip, step — with the numerical-fault rules of `NonFiniteGuard`.

    `backward=False`: the caller has already back-propagated (several backward passes per step: the
    micro-batches of `train.batching`), and `loss` / `aux` are only checked. `on_gradients()` runs between
    the backward and the clipping (per-tower gradient norms); not under DeepSpeed, whose engine steps inside
    its backward.

    `aux` is an auxiliary loss computed from detached encoder outputs (the corrector's): its gradient
    reaches only the optimizer groups marked `auxiliary`. Those are left out of the clipping norm, so a
    diverging corrector can neither poison nor rescale the encoder's gradient, and when `aux` (or its
    gradient) is not finite, or above `guard.aux_max_loss`, only those groups skip the update. Every process runs the
    backward (DDP needs it) and the decision is reduced over processes, so all of them take the same one.
    Under DeepSpeed see `_deepspeed_step`."""
    if deepspeed_stage(accelerator) is not None:
        if not backward:
            raise ConfigError("several backward passes per optimizer step (batching.micro_batches > 1) cannot run "
                              "under DeepSpeed, whose engine steps inside each backward; use batching.name=plain")
        return _deepspeed_step(accelerator, loss, guard, aux)
    aux_params = auxiliary_params(optimizer)
    aux_ids = {id(p) for p in aux_params}
    main_params = [p for p in params if id(p) not in aux_ids]
    if backward:
        accelerator.backward(loss if aux is None else loss + aux)
    if on_gradients is not None:
        on_gradients()
    main_norm = _finite_norm(main_params, max_grad_norm, accelerator)
    aux_norm = _finite_norm(aux_params, 0.0, accelerator) if aux_params else torch.zeros(())  # checked, not clipped
    aux_value = aux.detach().float().cpu() if aux is not None else torch.zeros(())
    flags = torch.tensor([
        not torch.isfinite(loss.detach()).all().item(),
        not bool(torch.isfinite(main_norm)),
        not bool(torch.isfinite(aux_value)),
        not bool(torch.isfinite(aux_norm)),
        guard.aux_max_loss > 0 and bool(aux_value > guard.aux_max_loss),
    ], dtype=torch.float32, device=accelerator.device)
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, reduction="sum")
    bad_loss, bad_grad, bad_aux_loss, bad_aux_grad, aux_exploding = (bool(v > 0) for v in flags.tolist())
    if getattr(accelerator, "scaler", None) is not None:  # fp16: the loss scaler skips inf-gradient steps itself
        bad_grad = bad_aux_grad = False
    bad, aux_bad = bad_loss or bad_grad, bad_aux_loss or bad_aux_grad or aux_exploding
    why = ("non-finite loss" if bad_loss else "non-finite gradient" if bad_grad
           else "non-finite corrector loss or gradient" if bad_aux_loss or bad_aux_grad
           else f"corrector loss above strategy.corrector.max_loss={guard.aux_max_loss}")
    guard.record(accelerator, bad, aux_bad, why)
    if not bad:
        if aux_bad:
            for p in aux_params:
                p.grad = None  # AdamW leaves parameters without a gradient (and their moments) untouched
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return not bad


def _deepspeed_step(accelerator: Accelerator, loss: torch.Tensor, guard: NonFiniteGuard,
                    aux: Optional[torch.Tensor]) -> bool:
    """`optimizer_step` under DeepSpeed. The engine updates inside `accelerator.backward` (engine.backward +
    engine.step, clipping by `train.max_grad_norm`), so gradients cannot be inspected before the update and
    the rules apply to the losses instead, decided on every process alike: a non-finite task loss skips the
    step (no backward); a non-finite corrector loss, or one above `aux_max_loss`, is left out of the backward.
    Its parameters then get a zero gradient, which AdamW still applies (moments), unlike the DDP path where
    they are left untouched; the same holds for any part without a gradient in a step (the RLM's retriever
    before its gate opens). A non-finite gradient norm after the update stops the run: the weights are lost
    but the last checkpoint is intact (fp16 loss scaling skips such steps inside DeepSpeed)."""
    aux_value = aux.detach().float() if aux is not None else torch.zeros((), device=loss.device)
    flags = torch.tensor([
        not torch.isfinite(loss.detach()).all().item(),
        not bool(torch.isfinite(aux_value)),
        guard.aux_max_loss > 0 and bool(aux_value > guard.aux_max_loss),
    ], dtype=torch.float32, device=accelerator.device)
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, reduction="sum")
    bad, bad_aux_loss, aux_exploding = (bool(v > 0) for v in flags.tolist())
    aux_bad = bad_aux_loss or aux_exploding
    why = ("non-finite loss" if bad else "non-finite corrector loss or gradient" if bad_aux_loss
           else f"corrector loss above strategy.corrector.max_loss={guard.aux_max_loss}")
    guard.record(accelerator, bad, aux_bad, why)
    if bad:
        return False
    accelerator.backward(loss if aux is None or aux_bad else loss + aux)
    norm = accelerator.deepspeed_engine_wrapped.engine.get_global_grad_norm()
    if norm is not None and not math.isfinite(float(norm)):
        raise FloatingPointError(
            f"non-finite gradient norm at step {guard.calls} under DeepSpeed, which had already applied the update; "
            "stopping. Lower train.lr or check the data; the last checkpoint is intact (train.resume=true).")
    return True


def save_pretrained_atomic(directory: Path, *objects: Any) -> None:
    """`save_pretrained` of each object (model, tokenizer) into one folder, written beside and swapped in."""
    from rag_train.io import atomic_directory, state_bytes

    needed = state_bytes(*(obj for obj in objects if isinstance(obj, torch.nn.Module))) + 2**20
    with atomic_directory(directory, "saving", needed=needed) as tmp:
        for obj in objects:
            obj.save_pretrained(str(tmp))


def linear_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then constant, the schedule both papers' recipes use by default."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))

"""A run directory is a unit: what marks one, when a new run may write into it (`train.resume=true` with the
same computation, or `train.overwrite=true`), which config keys a resumed run may change, and its one writer at a
time (`RunLock`)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rag_train.config import ConfigError, flatten
from rag_train.io import CorruptFileError, write_step
from rag_train.preemption import raised_by_every_process

CHECKPOINTS = "checkpoints"
CONFIG_FILE = "config.yaml"
CORPUS_RECORD = "corpus.json"  # rag_train.train.run_corpus.RECORD
LOGS = "logs"  # tracker output (<run>/logs/<recipe>/): never inside a folder that a saved model replaces
# What a run leaves in its directory: any of them marks it as a run (finished or partial) that a new run must
# not write into without train.resume=true (continue it) or train.overwrite=true (replace it).
RUN_OUTPUTS = (CONFIG_FILE, "metrics.json", CHECKPOINTS, "retriever", "reader", "predictions", "eval", "plots",
               "warm_start_retriever", "warm_start_reader")
# Config keys a resumed run may change: they do not alter what is computed (where the run lives, bookkeeping,
# evaluation cadence, and train.steps, which continues the same schedule: data order is a function of (seed, step);
# the CPU thread count changes only the order of float reductions).
RESUME_SAFE_KEYS = ("train.resume", "train.overwrite", "train.output_dir", "train.steps", "train.eval_every",
                    "train.log_every", "train.save_every", "train.keep_checkpoints", "train.tracker",
                    "train.collective_timeout", "train.cpu_threads", "train.max_bad_steps", "buffer.verify",
                    "buffer.token_cache")
# Sections only the evaluations read (during training and the final one), never the trained weights: a run whose
# final evaluation failed is finished by resuming it with these keys corrected.
RESUME_SAFE_SECTIONS = ("eval.",)


def resume_safe(key: str) -> bool:
    return key in RESUME_SAFE_KEYS or key.startswith(RESUME_SAFE_SECTIONS)


def claim_directory(cfg: Any, directory: Path) -> None:
    """A directory holding a run (finished or partial) is only continued (`train.resume=true`, with the same
    computation: `check_resumed_config`) or replaced (`train.overwrite=true`); otherwise ConfigError
    before anything is written."""
    train = cfg.train
    if train.resume and train.overwrite:
        raise ConfigError("train.resume=true and train.overwrite=true contradict each other: choose one")
    found = [name for name in RUN_OUTPUTS if (directory / name).exists()]
    if not found or train.overwrite:
        return
    if train.resume:
        check_resumed_config(cfg, directory)
        return
    raise ConfigError(
        f"{directory} already holds a run ({', '.join(found)}): pass train.resume=true to continue it, "
        "train.overwrite=true to replace it, or choose another train.output_dir (nothing was overwritten)")


def check_resumed_config(cfg: Any, directory: Path) -> None:
    """ConfigError naming every key whose value differs from the run's saved config.yaml, unless it is in
    RESUME_SAFE_KEYS / RESUME_SAFE_SECTIONS: a resumed run must compute what the uninterrupted one would have
    (an edited lr, seed, batch size or shape is refused before config.yaml is rewritten). Keys the saved config
    does not have (written by an older version) count as their defaults."""
    from omegaconf import OmegaConf

    saved_path = directory / CONFIG_FILE
    if not saved_path.is_file():
        return
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_path))
    except Exception as exc:
        raise CorruptFileError(f"{saved_path}: not readable as YAML ({exc}); the run cannot be checked") from None
    defaults = flatten(OmegaConf.to_container(OmegaConf.structured(type(cfg))))
    found = {**defaults, **flatten(saved)}
    wanted = flatten(OmegaConf.to_container(OmegaConf.structured(cfg)))
    changed = sorted(key for key in found.keys() | wanted.keys()
                     if found.get(key) != wanted.get(key) and not resume_safe(key))
    if changed:
        shown = "; ".join(f"{key}: {found.get(key)!r} -> {wanted.get(key)!r}" for key in changed)
        raise ConfigError(
            f"{saved_path}: train.resume=true with settings that change the computation ({shown}). Resume with "
            f"the saved values, or start a new run (another train.output_dir, or train.overwrite=true). Only "
            f"{', '.join(k for k in RESUME_SAFE_KEYS if k != 'train.resume')} and the "
            f"{', '.join(s + '*' for s in RESUME_SAFE_SECTIONS)} keys may change on resume.")


def remove_previous_run(directory: Path) -> None:
    """train.overwrite=true: the previous run's outputs go before anything new is written (its own buffer is
    kept: `ensure_buffer` reuses it only if it was built by this run's initial model and corpus)."""
    for name in (*RUN_OUTPUTS, LOGS):
        path = directory / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


LOCK_FILE = ".lock"


class RunLockedError(ConfigError):
    """Another process writes into the run directory (exit status 2, like any input that cannot be run)."""


class RunLock:
    """One writer per run directory: an advisory `flock` on `<dir>/.lock`, which names its holder (pid, host, what it
    does). The kernel drops the lock when its holder dies, however it dies, so a lock file left by a dead holder is
    taken over (with a warning), and a live holder's never is."""

    def __init__(self, directory: Path, purpose: str, beside: bool = False):
        """`beside`: the lock file is `.<name>.lock` next to `directory`, for a folder that is written whole
        elsewhere and swapped in (an export), which would swap a lock file inside it away."""
        directory = Path(directory)
        self.subject = directory
        self.path = directory.parent / f".{directory.name}.lock" if beside else directory / LOCK_FILE
        self.purpose = purpose
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """RunLockedError naming the holder when another process holds the lock. A lock this process took for an
        earlier writer it never closed (a run object left behind in a notebook or test) passes to this one."""
        earlier = _HELD.get(self.path.resolve())
        if earlier is not None:
            earlier.release()
        while True:
            with write_step("taking the lock of", self.subject):  # a read-only folder: exit 5
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLockedError(
                    f"{self.subject} is in use: {_holder_text(_read_holder(self.path))} writes there (lock file "
                    f"{self.path}); wait for it to end, or choose another directory. Nothing was written.") from None
            try:
                previous = _read_holder(self.path)
                record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                                     "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
                with write_step("writing the lock file", self.path):
                    os.pwrite(fd, record, 0)
                    os.ftruncate(fd, len(record))
                    os.fsync(fd)
                if _same_file(fd, self.path):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # its holder removed the file between our open and our lock: lock the new one
        if previous and previous.get("pid") != os.getpid():
            same_host = previous.get("host") == socket.gethostname()
            print(f"warning: taking over the stale lock {self.path} of {_holder_text(previous)}, "
                  f"{'which is no longer running' if same_host else 'which no longer holds it'}",
                  file=sys.stderr, flush=True)
        self.fd = fd
        _HELD[self.path.resolve()] = self
        return self

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no other writer holds a removed file), then unlock."""
        if self.fd is None:
            return
        if _same_file(self.fd, self.path):
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        if _HELD.get(self.path.resolve()) is self:
            del _HELD[self.path.resolve()]
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


_HELD: dict[Path, RunLock] = {}  # the locks this process holds, by lock file


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read_holder(path: Path) -> dict:
    """The holder a lock file names; {} for an empty or unreadable one."""
    try:
        holder = json.loads(path.read_bytes() or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _holder_text(holder: dict) -> str:
    if not holder:
        return "another process (not yet named in the lock file)"
    return (f"pid {holder.get('pid')} on host {holder.get('host')} ({holder.get('purpose', 'a writer')}, since "
            f"{holder.get('since', '?')})")


def lock_run_directory(directory: Path, purpose: str, accelerator: Any) -> Optional[RunLock]:
    """The main process takes the directory's lock; every process learns the outcome through one broadcast, so
    a refusal stops all of them at the same point (RunLockedError) before any of them writes. The main process
    gets the lock to release, the others None."""
    lock, refusal = None, None
    if accelerator.is_main_process:
        try:
            lock = RunLock(directory, purpose).acquire()
        except RunLockedError as exc:
            refusal = str(exc)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        refusal = broadcast_object_list([refusal], from_process=0)[0]
    if refusal is not None:
        raise raised_by_every_process(RunLockedError(refusal))
    return lock

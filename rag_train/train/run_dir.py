"""A run directory is a unit: what marks one, when a new run may write into it (`train.resume=true` with the
same computation, or `train.overwrite=true`), and which config keys a resumed run may change."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rag_train.config import ConfigError, flatten
from rag_train.io import CorruptFileError

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
                    "train.collective_timeout", "train.cpu_threads", "train.max_bad_steps", "buffer.verify")


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
    RESUME_SAFE_KEYS: a resumed run must compute what the uninterrupted one would have (an edited lr,
    seed, batch size or shape is refused before config.yaml is rewritten). Keys the saved config does not
    have (written by an older version) count as their defaults."""
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
                     if found.get(key) != wanted.get(key) and key not in RESUME_SAFE_KEYS)
    if changed:
        shown = "; ".join(f"{key}: {found.get(key)!r} -> {wanted.get(key)!r}" for key in changed)
        raise ConfigError(
            f"{saved_path}: train.resume=true with settings that change the computation ({shown}). Resume with "
            f"the saved values, or start a new run (another train.output_dir, or train.overwrite=true). Only "
            f"{', '.join(k for k in RESUME_SAFE_KEYS if k != 'train.resume')} may change on resume.")


def remove_previous_run(directory: Path) -> None:
    """train.overwrite=true: the previous run's outputs go before anything new is written (its own buffer is
    kept: `ensure_buffer` reuses it only if it was built by this run's initial model and corpus)."""
    for name in (*RUN_OUTPUTS, LOGS):
        path = directory / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

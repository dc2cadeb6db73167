"""Resolve a run's data section to concrete files: the toy world (generated on first use) or the user's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from accelerate import Accelerator

from rag_train.config import DataConfig


@dataclass
class DataFiles:
    passages: str
    train: list[str]
    dev: list[str]
    tokenizer: Optional[str]  # the toy tokenizer for tiny models; None for user data


def resolve_data(cfg: DataConfig, accelerator: Accelerator, train_keys: list[str], dev_keys: list[str]) -> DataFiles:
    """Paths for this run. With `data.toy` the toy world is built once (main process first, the others
    wait) and `train_keys` / `dev_keys` pick its files (e.g. ["retrieval-train"], ["nq-dev", "tqa-dev"]).
    `data.train` may name several files separated by commas; their examples are concatenated."""
    user_train = [part for part in (cfg.train or "").split(",") if part]
    if not cfg.toy:
        return DataFiles(cfg.passages, user_train, list(cfg.dev), None)
    from rag_train.data.toy import ensure_toy_world

    with accelerator.main_process_first():
        files = ensure_toy_world(cfg)
    return DataFiles(
        passages=cfg.passages or str(files["passages"]),
        train=user_train or [str(files[key]) for key in train_keys],
        dev=list(cfg.dev) or [str(files[key]) for key in dev_keys],
        tokenizer=str(files["tokenizer"]),
    )


def dataset_name(path: str) -> str:
    """Metrics key for an evaluation file: its stem without a split suffix (`nq-dev.jsonl` -> `nq`)."""
    stem = Path(path).name.split(".")[0]
    for suffix in ("-dev", "-test", "-validation", "-train", "_dev", "_test"):
        if stem.endswith(suffix):
            return stem[: -len(suffix)]
    return stem

"""Resolve a run's data section to concrete files: the toy world (generated on first use) or the user's."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from accelerate import Accelerator

from rag_train.config import ConfigError, DataConfig
from rag_train.io import read_json

TOY_LM_MANIFEST = "toy_lm.json"  # in a folder made by the LM pre-training stage (rag_train/train/lm_pretrain.py)


@dataclass
class DataFiles:
    passages: str
    train: list[str]
    dev: list[str]
    tokenizer: Optional[str]  # the toy tokenizer for tiny models; None for user data


def world_fingerprint(manifest: Path) -> str:
    """sha256 of a toy world's manifest.json: the same parameters and version give the same world and digest."""
    return hashlib.sha256(Path(manifest).read_bytes()).hexdigest()


def check_toy_init(key: str, model: str, manifest: Path) -> None:
    """ConfigError if `model` (the value of config key `key`) is a toy LM folder pretrained on another toy world
    than the one whose manifest is `manifest`: its tokenizer and what it learned belong to other entities."""
    record = Path(model) / TOY_LM_MANIFEST
    if not record.is_file():
        return
    made_on = read_json(record).get("world")
    if made_on != world_fingerprint(manifest):
        raise ConfigError(f"{key}={model!r} was pretrained on another toy world ({record}: field 'world' is "
                          f"{str(made_on)[:12]}..., {manifest} hashes to {world_fingerprint(manifest)[:12]}...); "
                          "pretrain it on this world: "
                          f"python scripts/pretrain_toy_lm.py data.toy_dir={manifest.parent}")


def resolve_data(cfg: DataConfig, accelerator: Accelerator, train_keys: list[str], dev_keys: list[str],
                 inits: Optional[dict[str, str]] = None) -> DataFiles:
    """Paths for this run. With `data.toy` the toy world is built once (main process first, the others
    wait) and `train_keys` / `dev_keys` pick its files (e.g. ["retrieval-train"], ["nq-dev", "tqa-dev"]).
    `data.train` may name several files separated by commas; their examples are concatenated. `inits` maps
    config keys to model folders (`{"retriever.model": ...}`): a toy LM folder made on another world is refused."""
    user_train = [part for part in (cfg.train or "").split(",") if part]
    if not cfg.toy:
        return DataFiles(cfg.passages, user_train, list(cfg.dev), None)
    from rag_train.data.toy_files import ensure_toy_world

    with accelerator.main_process_first():
        files = ensure_toy_world(cfg)
    for key, model in (inits or {}).items():
        check_toy_init(key, model, files["manifest"])
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

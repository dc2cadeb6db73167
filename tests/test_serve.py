"""Serving: request coalescing, and a real server on loopback answering, rejecting and shutting down."""

import asyncio
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

from rag_train.buffer.embed import embed_rows
from rag_train.buffer.search import search
from rag_train.data.corpus import Corpus
from rag_train.serve import MicroBatcher
from test_export import exported


def _echo_batcher(max_batch_queries, sizes):
    """A batcher whose 'search' records batch sizes and answers each query with itself k times."""
    def run_batch(queries, k):
        sizes.append(len(queries))
        return [{"ids": [q] * k} for q in queries]

    return MicroBatcher(run_batch, max_batch_queries, max_wait_s=0.001)


def test_concurrent_requests_share_one_batch_and_get_their_own_answers():
    async def scenario():
        sizes = []
        batcher = _echo_batcher(64, sizes)
        worker = asyncio.create_task(batcher.run())
        answers = await asyncio.gather(*(batcher.submit([f"q{i}a", f"q{i}b"], k=1 + i % 3) for i in range(6)))
        worker.cancel()
        return sizes, answers

    sizes, answers = asyncio.run(scenario())
    assert sizes == [12]  # all six requests were queued before the worker woke: one encoder batch
    for i, answer in enumerate(answers):
        assert answer == [{"ids": [f"q{i}a"] * (1 + i % 3)}, {"ids": [f"q{i}b"] * (1 + i % 3)}]


def test_batches_respect_the_query_cap():
    async def scenario():
        sizes = []
        batcher = _echo_batcher(3, sizes)
        worker = asyncio.create_task(batcher.run())
        answers = await asyncio.gather(*(batcher.submit([f"q{i}"], k=1) for i in range(7)))
        worker.cancel()
        return sizes, answers

    sizes, answers = asyncio.run(scenario())
    assert sizes == [3, 3, 1]
    assert [a[0]["ids"] for a in answers] == [[f"q{i}"] for i in range(7)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, recipe_toy_dir):
    export_dir, model, manifest = exported(tmp_path_factory, recipe_toy_dir, faiss_factory="Flat", onnx=True,
                                             copy_corpus=True)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rag_train.cli", "serve", "--export", str(export_dir),
                             "--host", "127.0.0.1", "--port", str(port), "--max-queries", "4",
                             "--max-query-chars", "50", "--max-k", "20", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not answer /health within 90 s")
        time.sleep(0.3)
    yield url, proc, export_dir, model
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_search_returns_the_exact_top_k(server):
    url, _, export_dir, model = server
    corpus = Corpus.open(export_dir / "passages.jsonl")  # the export's own copy
    questions = ["Who trained Bihe Ziturin?", "Which colour does Migor wear?"]
    response = httpx.post(f"{url}/search", json={"queries": questions, "k": 5}, timeout=30)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    with torch.no_grad():
        model.eval()
        expected = search(model.encode_queries(questions), embed_rows(model, corpus, np.arange(len(corpus)), 64,
                                                                      torch.device("cpu")), k=5)
    for result, rows, scores in zip(results, expected.rows.tolist(), expected.scores.tolist()):
        assert result["ids"] == [corpus.id(r) for r in rows]
        assert result["titles"] == [corpus.title(r) for r in rows] and result["texts"] == [corpus.text(r) for r in rows]
        np.testing.assert_allclose(result["scores"], scores, atol=1e-4)


def test_concurrent_clients_get_the_answers_of_single_requests(server):
    url = server[0]
    questions = [f"Who plays the viola number {i}?" for i in range(8)]

    async def ask_all():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await asyncio.gather(*(client.post("/search", json={"queries": [q], "k": 3 + i % 2})
                                          for i, q in enumerate(questions)))

    together = asyncio.run(ask_all())
    for i, (question, response) in enumerate(zip(questions, together)):
        alone = httpx.post(f"{url}/search", json={"queries": [question], "k": 3 + i % 2}, timeout=30)
        assert response.status_code == alone.status_code == 200
        assert response.json()["results"][0]["ids"] == alone.json()["results"][0]["ids"]
        assert len(response.json()["results"][0]["ids"]) == 3 + i % 2
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["requests"] >= 16 and health["batches"] <= health["requests"] and health["passages"] == 300


@pytest.mark.parametrize("body, status, says", [
    ({"queries": ["a", "b", "c", "d", "e"], "k": 3}, 422, "at most 4 items"),
    ({"queries": ["x" * 51]}, 422, "at most 50 characters"),
    ({"queries": ["   "]}, 422, "at least 1 character"),
    ({"queries": []}, 422, "at least 1 item"),
    ({"queries": ["ok"], "k": 21}, 422, "less than or equal to 20"),
    ({"queries": ["ok"], "k": 0}, 422, "greater than or equal to 1"),
    ({"queries": ["ok"], "k": "5"}, 422, "valid integer"),
    ({"queries": [7]}, 422, "valid string"),
    ({"queries": ["ok"], "top": 3}, 422, "Extra inputs"),
    ({"question": "ok"}, 422, "Field required"),
])
def test_bad_requests_get_4xx_saying_what_is_wrong(server, body, status, says):
    response = httpx.post(f"{server[0]}/search", json=body, timeout=10)
    assert response.status_code == status
    assert says in response.text


def test_malformed_and_oversized_bodies_are_rejected(server):
    url = server[0]
    broken = httpx.post(f"{url}/search", content=b'{"queries": ["a"', headers={"content-type": "application/json"})
    assert broken.status_code == 422 and "JSON decode error" in broken.text
    huge = httpx.post(f"{url}/search", json={"queries": ["y" * 200_000]}, timeout=10)
    assert huge.status_code == 413 and "larger than this server accepts" in huge.json()["detail"]
    assert httpx.get(f"{url}/search").status_code == 405


def test_sigterm_stops_the_server_cleanly(server):
    url, proc, _, _ = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)

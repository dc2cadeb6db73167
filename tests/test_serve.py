"""Serving: request coalescing, and a real server on loopback answering, rejecting and shutting down."""

import ast
import asyncio
import json
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from rag_train.buffer.embed import embed_rows
from rag_train.buffer.search import search
from rag_train.data.corpus import Corpus
from rag_train.serving.serve import MicroBatcher, ServeLimits, create_app, validation_detail

from test_export import _isolated_python, exported

# one xdist worker runs the whole file: the export is built and its server started once (module fixture)
pytestmark = pytest.mark.xdist_group("test_serve")

ROOT = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT = 3  # the module server's --request-timeout (seconds; the default is 10)


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
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                             "--request-timeout", str(REQUEST_TIMEOUT)],  # default limits
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # startup imports torch, faiss and the model: slow on a busy machine
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
            pytest.fail("server did not answer /health within 300 s")
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


def error_table() -> list[tuple]:
    """The rows of docs/serving.md's error table: (problem, content type, body, status, field, detail says)."""
    lines = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- error-table"))
    rows = []
    for line in lines[start + 3:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        problem, content_type, body, status, field, says = cells
        rows.append(pytest.param(content_type, eval(body, {"__builtins__": {"iter": iter}}), int(status), field,
                                 says, id=problem.replace("`", "")))
    return rows


@pytest.mark.parametrize("content_type, body, status, field, says", error_table())
def test_bad_requests_get_the_documented_4xx(server, content_type, body, status, field, says):
    response = httpx.post(f"{server[0]}/search", content=body, headers={"content-type": content_type}, timeout=30)
    assert response.status_code == status, response.text[:500]
    assert len(response.content) < 1000  # the body is never echoed back
    detail = response.json()["detail"]
    if field:
        assert any(".".join(map(str, error["loc"])) == field and says in error["msg"] for error in detail), detail
    else:
        assert isinstance(detail, str) and says in detail, detail


def test_error_table_covers_every_kind_of_answer(server):
    statuses = {param.values[2] for param in error_table()}
    assert statuses == {400, 413, 415, 422}
    assert httpx.get(f"{server[0]}/search").status_code == 405


@pytest.mark.parametrize("character", ["\u00e9", "\U0001F600"], ids=["e-acute", "outside-the-BMP"])
def test_escaped_non_ascii_questions_within_the_limits_are_answered(server, character):
    """32 questions of 1,000 characters each, every character \\u-escaped as json.dumps writes it (6
    bytes each, 12 for a surrogate pair: a 192 / 384 KB body for 32,000 characters) are within the limits, which are
    on the parsed request, and answered (was 413, a limit on the escaped bytes); one character more in a question is
    a 422 saying it counts characters."""
    body = json.dumps({"queries": [character * 1000] * 32, "k": 1}).encode()
    assert body.isascii() and len(body) > 190_000
    response = httpx.post(f"{server[0]}/search", content=body, headers={"content-type": "application/json"},
                          timeout=120)
    assert response.status_code == 200, response.text[:500]
    assert len(response.json()["results"]) == 32
    too_long = json.dumps({"queries": [character * 1001]}).encode()
    response = httpx.post(f"{server[0]}/search", content=too_long, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == 422, response.text[:500]
    assert response.json()["detail"][0]["loc"] == ["body", "queries", 0]
    assert "at most 1000 characters" in response.json()["detail"][0]["msg"]


def test_validation_detail_never_fails_and_never_echoes():
    errors = [{"loc": ("queries", 0), "msg": "bad", "type": "value_error", "input": "\ud800",
               "ctx": {"error": ValueError()}},
              {"loc": ("k",), "msg": "not int", "type": "int_type", "input": float("nan")}]
    assert validation_detail(errors) == [{"loc": ["body", "queries", 0], "msg": "bad", "type": "value_error"},
                                         {"loc": ["body", "k"], "msg": "not int", "type": "int_type"}]
    assert validation_detail([{"loc": None}]) == [{"loc": ["body"], "msg": "the body does not match the request "
                                                   "schema", "type": "value_error"}]


def test_an_oversized_streamed_body_is_not_read_past_the_limit(tmp_path_factory, recipe_toy_dir):
    """In process, exactly: the app pulls at most limit + one chunk of a 96 MB body (chunked: no Content-Length)."""
    export_dir, _, _ = exported(tmp_path_factory, recipe_toy_dir, faiss_factory="Flat", onnx=True, copy_corpus=True)
    limits = ServeLimits()
    app = create_app(export_dir, limits)
    chunk, total = b"y" * 65536, 96 * 2**20
    pulled, sent = [0], []

    async def receive():
        pulled[0] += 1
        more = pulled[0] * len(chunk) < total
        return {"type": "http.request", "body": chunk, "more_body": more}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/search", "raw_path": b"/search", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert pulled[0] == limits.max_body_bytes // len(chunk) + 1  # stopped at the first chunk past the limit
    assert b"larger than this server reads" in sent[1]["body"] and len(sent[1]["body"]) < 1000


def test_a_chunked_body_over_the_limit_is_cut_off_on_a_real_server(server):
    """A raw HTTP/1.1 client streams a 96 MB chunked body: the 413 comes back after a few MB at most (what the
    sockets' buffers hold), not after the whole body, and holds no part of the body."""
    url = server[0]
    port = int(url.rsplit(":", 1)[1])
    total, piece = 96 * 2**20, b"y" * 65536
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent, response = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + frame.replace(piece[:14], b'{"queries": ["', 1))
        sent = len(piece)
        try:
            while sent < total and not select.select([sock], [], [], 0)[0]:
                sock.sendall(frame)
                sent += len(piece)
            if sent >= total:  # the whole body went out: end it, so a server that reads it all answers
                sock.sendall(b'2\r\n"]\r\n0\r\n\r\n')
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        try:
            while chunk := sock.recv(65536):
                response += chunk
        except ConnectionResetError:
            pass
    assert response.startswith(b"HTTP/1.1 413"), response[:300]
    assert b"larger than this server reads" in response and len(response) < 2000
    assert sent < total // 4, sent  # cut off early: the whole 96 MB was not read


def test_a_chunked_gigabyte_gets_413_and_its_connection_closed(server):
    """A client streams up to 1 GB chunked, without asking for the connection to be closed: the 413 says
    `Connection: close` and the server closes the connection (docs/serving.md) instead of reading, and discarding,
    the rest of the body while the client keeps sending. The close is a lingering one (the answer, FIN, then what
    still arrives drained for up to 2 s): a plain close with unread bytes resets the connection, and the reset could
    discard the queued 413 before the client read it (3 failures in 8 runs on a loaded machine before)."""
    port = int(server[0].rsplit(":", 1)[1])
    total, piece = 2**30, b"y" * 65536
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent, response, closed = 0, b"", False
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + frame.replace(piece[:14], b'{"queries": ["', 1))
        sent = len(piece)
        try:
            while sent < total and not select.select([sock], [], [], 0)[0]:
                sock.sendall(frame)
                sent += len(piece)
            assert sent < total, "the server never answered"
            while b"\r\n\r\n" not in response:  # the answer's head
                response += sock.recv(65536)
            # keep sending, as a client that does not read while it writes would, for up to 10 s: the server must
            # have closed the connection (EOF or reset), not be reading the body on
            deadline = time.monotonic() + 10
            sock.settimeout(1)
            while time.monotonic() < deadline and not closed:
                if select.select([sock], [], [], 0)[0]:
                    chunk = sock.recv(65536)
                    response += chunk
                    closed = not chunk
                else:
                    sock.sendall(frame)
                    sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            closed = True
    head = response.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 413"), response[:300]
    assert b"\r\nconnection: close" in head, head
    assert closed and sent < total // 4, sent


@pytest.mark.parametrize("path", ["/search", "/health"])
def test_content_length_with_transfer_encoding_gets_400_and_the_connection_closed(server, path):
    """Both framing headers (request smuggling behind a proxy that frames by the other one): 400, `Connection:
    close`, and the connection ends; the smuggled request after the body is never answered."""
    port = int(server[0].rsplit(":", 1)[1])
    body = b'{"queries": ["a"], "k": 1}'
    smuggled = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    method = b"POST" if path == "/search" else b"GET"
    response = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(method + b" " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(body)
                     + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n" + smuggled)
        try:
            while chunk := sock.recv(65536):  # until the server closes the connection
                response += chunk
        except ConnectionResetError:
            pass
    head = response.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 400"), response[:300]
    assert b"\r\nconnection: close" in head and b"ambiguous" in response
    assert response.count(b"HTTP/1.1") == 1  # one answer: the smuggled request was not read


def test_stalled_clients_are_cut_off_and_do_not_delay_others(server):
    """Slowloris (loopback only): 100 connections that stall inside their headers and 100 that send their
    headers and stall inside the body. A healthy client is answered within its usual latency meanwhile, and after
    --request-timeout every stalled connection is closed (the body stalls with a 408) instead of being held."""
    import selectors

    url = server[0]
    port = int(url.rsplit(":", 1)[1])
    body = {"queries": ["Who trained Bihe Ziturin?"], "k": 3}

    def latencies(count: int = 5) -> list[float]:
        out = []
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(count):
                started = time.monotonic()
                assert client.post("/search", json=body).status_code == 200
                out.append(time.monotonic() - started)
        return out

    usual = latencies()
    stalled = []
    opened = time.monotonic()
    for i in range(200):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 2:
            sock.sendall(b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: applica")  # headers cut off
        else:
            sock.sendall(b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 64\r\n\r\n{\"queries\": [")  # headers whole, the body cut off
        stalled.append(sock)
    try:
        meanwhile = latencies()
        assert max(meanwhile) < 5 * max(usual) + 1.0, (usual, meanwhile)
        answers = {sock: b"" for sock in stalled}
        selector = selectors.DefaultSelector()
        for sock in stalled:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        deadline = opened + REQUEST_TIMEOUT + 20
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1):
                try:
                    chunk = key.fileobj.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                answers[key.fileobj] += chunk
                if not chunk:
                    selector.unregister(key.fileobj)
        elapsed = time.monotonic() - opened
        assert not selector.get_map(), f"{len(selector.get_map())} of 200 stalled connections still open"
        assert elapsed >= REQUEST_TIMEOUT - 0.5  # closed by the timeout, not at once
        for i, sock in enumerate(stalled):
            if i % 2:
                assert answers[sock] == b"", answers[sock][:200]  # no request yet: nothing to answer
            else:
                assert answers[sock].startswith(b"HTTP/1.1 408"), answers[sock][:200]
                assert b"within 3 s of its headers" in answers[sock]
        assert latencies(1)[0] < 5 * max(usual) + 1.0  # and the server still answers
    finally:
        for sock in stalled:
            sock.close()


def doc_examples() -> dict[str, str]:
    """The `<!-- example: NAME -->` python blocks of docs/serving.md, by name."""
    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    examples = {}
    for part in text.split("<!-- example: ")[1:]:
        name, rest = part.split(" -->", 1)
        examples[name] = rest.split("```python\n", 1)[1].split("```", 1)[0]
    return examples


def test_the_docs_show_every_export_format():
    assert sorted(doc_examples()) == ["faiss", "http", "onnxruntime", "sentence-transformers"]


@pytest.mark.slow
def test_doc_examples_run_without_the_package_and_rank_as_rag_train_does(server, tmp_path):
    """Each example, copied from the docs, runs where rag_train cannot be imported (cwd holds `export`, the http
    example is pointed at the test server) and prints the same top-5 ids as rag-train's exact search. One
    interpreter runs them all (each in fresh globals), to import torch and transformers once."""
    url, _, export_dir, model = server
    examples = {name: code.replace("http://127.0.0.1:8000", url) for name, code in doc_examples().items()}
    (tmp_path / "export").symlink_to(export_dir)
    driver = f"""
import sys
try:
    import rag_train
    sys.exit("rag_train is importable")
except ImportError:
    pass
for name, code in {examples!r}.items():
    print("=== " + name, flush=True)
    exec(compile(code, name, "exec"), {{"__name__": "__main__"}})
"""
    result = _isolated_python(driver, tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = {}
    for block in result.stdout.split("=== ")[1:]:
        name, *lines = block.splitlines()
        printed[name] = dict(line.split(" -> ") for line in lines if " -> " in line)
    assert sorted(printed) == sorted(examples)
    corpus = Corpus.open(export_dir / "passages.jsonl")
    questions = list(printed["http"])
    with torch.no_grad():
        model.eval()
        expected = search(model.encode_queries(questions),
                          embed_rows(model, corpus, np.arange(len(corpus)), 64, torch.device("cpu")), k=5)
    assert len(questions) == 2
    for name, answers in printed.items():
        assert list(answers) == questions, name
        for question, rows in zip(questions, expected.rows.tolist()):
            assert ast.literal_eval(answers[question]) == [corpus.id(r) for r in rows], (name, question)


# last: it stops the module's server
def test_sigterm_stops_the_server_cleanly(server):
    url, proc, _, _ = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)

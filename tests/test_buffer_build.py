"""Buffer on-disk format and the resumable, length-sorted, multi-process buffer build."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_train.buffer.build import build_buffer, plan_shards, shards_of_process
from rag_train.buffer.embed import length_sorted_order
from rag_train.buffer.store import Buffer, BufferError, vectors_fingerprint
from rag_train.cli import PREEMPTED_EXIT
from rag_train.config import RetrieverConfig, TinyModelConfig
from rag_train.data.corpus import Corpus
from rag_train.data.tokenizer import train_tokenizer
from rag_train.io import sha256_file
from rag_train.launch import launch_command
from rag_train.models.retriever import DualEncoder, format_passage

ROOT = Path(__file__).resolve().parents[1]
TINY = TinyModelConfig(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=1, num_decoder_layers=1)
ROWS, SHARD_ROWS, BATCH = 37, 10, 4
WORDS = "alpha beta gamma delta river stone tower city founded painted green blue north old".split()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A 37-passage corpus of varied lengths, a tokenizer, a tiny saved retriever."""
    root = tmp_path_factory.mktemp("buffer-world")
    rng = np.random.default_rng(0)
    with open(root / "passages.jsonl", "w", encoding="utf-8") as handle:
        for i in range(ROWS):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 40))))
            handle.write(json.dumps({"id": f"p{i}", "title": f"Entity {i}", "text": text}) + "\n")
    corpus = Corpus.open(root / "passages.jsonl")
    texts = [format_passage(p) for p in corpus.passages(range(ROWS))]
    tokenizer = train_tokenizer(texts, root / "tok", vocab_size=500)
    model = DualEncoder.from_config(RetrieverConfig(model="tiny", tiny=TINY, projection_dim=16), tokenizer).eval()
    model.save(root / "model")
    return {"root": root, "corpus": corpus, "model": model, "tokenizer": root / "tok"}


def counting(model) -> list[int]:
    """Record the batch sizes the embedding path encodes (`model.encode_passage_features`)."""
    calls, encode = [], model.encode_passage_features

    def wrapped(features):
        calls.append(len(features["input_ids"]))
        return encode(features)

    model.encode_passage_features = wrapped
    return calls


def direct(model, corpus) -> torch.Tensor:
    with torch.inference_mode():
        return model.encode_passages(corpus.passages(range(len(corpus))))


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("shard-*.npy"))}


def test_shard_plan_and_length_order():
    assert plan_shards(25, 10) == [(0, 10), (10, 20), (20, 25)]
    assert [list(shards_of_process(5, r, 2)) for r in range(2)] == [[0, 1], [2, 3, 4]]
    assert sorted(i for r in range(3) for i in shards_of_process(7, r, 3)) == list(range(7))
    assert length_sorted_order(np.array([5, 1, 5, 0])).tolist() == [3, 1, 0, 2]  # ties keep row order


def test_build_equals_direct_encoding(world, tmp_path):
    model, corpus = world["model"], world["corpus"]
    calls = counting(model)
    buffer = build_buffer(model, corpus, tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS, dtype="float32")
    assert sum(calls) == ROWS and max(calls) == BATCH
    assert (buffer.rows, buffer.dim, len(buffer.manifest["shards"])) == (ROWS, 16, 4)
    assert buffer.manifest["model_fingerprint"] == vectors_fingerprint(world["model"])
    assert buffer.manifest["corpus_fingerprint"] == corpus.fingerprint
    reference = direct(world["model"], corpus)  # one unsorted, fully padded batch
    # length-sorted batches of 4 give the same vectors as one padded batch in row order
    torch.testing.assert_close(torch.from_numpy(buffer.array()), reference, atol=1e-5, rtol=1e-5)
    for shard in buffer.manifest["shards"]:
        assert sha256_file(buffer.path / shard["file"]) == shard["sha256"]


def test_float16_and_bfloat16_builds(world, tmp_path):
    reference = direct(world["model"], world["corpus"])
    half = build_buffer(world["model"], world["corpus"], tmp_path / "fp16", batch_size=BATCH, shard_rows=SHARD_ROWS)
    assert half.array().dtype == np.float16
    torch.testing.assert_close(torch.from_numpy(half.array()).float(), reference, atol=2e-3, rtol=0)
    bf16 = build_buffer(world["model"], world["corpus"], tmp_path / "bf16", batch_size=BATCH, shard_rows=SHARD_ROWS,
                        dtype="bfloat16")
    assert bf16.tensor().dtype == torch.bfloat16
    torch.testing.assert_close(bf16.tensor().float(), reference.bfloat16().float(), atol=1e-2, rtol=0)


def test_buffer_views_span_shards(tmp_path):
    matrix = torch.arange(50 * 3, dtype=torch.float32).reshape(50, 3)
    buffer = Buffer.write(tmp_path / "b", matrix, dtype="float32", shard_rows=20)
    assert isinstance(buffer.shard(20, 40), np.memmap)  # inside one file: no copy
    np.testing.assert_array_equal(buffer.shard(15, 45), matrix[15:45].numpy())
    assert [start for start, _ in buffer.views(15, 45)] == [15, 20, 40]
    np.testing.assert_array_equal(buffer.array(), matrix.numpy())
    assert torch.equal(buffer.tensor(5, 25), matrix[5:25])
    with pytest.raises(IndexError):
        buffer.shard(40, 51)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_buffer_moments_over_shards(tmp_path, dtype):
    """Per-dimension mean and population sd streamed over 3 shards in chunks of 7 rows = numpy over the decoded rows."""
    matrix = torch.randn(50, 4, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 3.0, 0.1, 10.0]) + 2
    buffer = Buffer.write(tmp_path / "b", matrix, dtype=dtype, shard_rows=20)
    stored = buffer.gather(np.arange(50)).astype(np.float64)
    mean, std = buffer.moments(chunk_rows=7)
    np.testing.assert_allclose(mean.numpy(), stored.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(std.numpy(), stored.std(axis=0), rtol=1e-9)


def test_open_refuses_mismatch_incomplete_and_corruption(tmp_path):
    Buffer.write(tmp_path / "b", torch.ones(6, 4), model_fingerprint="m1", corpus_fingerprint="c1", shard_rows=4)
    assert Buffer.open(tmp_path / "b", "m1", "c1").rows == 6
    with pytest.raises(BufferError, match="model_fingerprint.*different retriever model"):
        Buffer.open(tmp_path / "b", model_fingerprint="m2")
    with pytest.raises(BufferError, match="corpus_fingerprint.*different corpus"):
        Buffer.open(tmp_path / "b", corpus_fingerprint="c2")
    shard = tmp_path / "b" / "shard-00001.npy"
    array = np.load(shard)
    array[0, 0] = 7
    np.save(shard, array)
    Buffer.open(tmp_path / "b")  # same shape: only a checksum can tell
    with pytest.raises(BufferError, match="sha256 of .*shard-00001.npy"):
        Buffer.open(tmp_path / "b", verify=True)
    shard.unlink()
    with pytest.raises(BufferError, match=r"shards\[1\].*missing"):
        Buffer.open(tmp_path / "b")
    manifest = tmp_path / "b" / "manifest.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), complete=False)))
    with pytest.raises(BufferError, match="interrupted"):
        Buffer.open(tmp_path / "b")
    with pytest.raises(BufferError, match="not found"):
        Buffer.open(tmp_path / "nothing")


def test_existing_buffer_is_reused_or_protected(world, tmp_path):
    model, corpus = DualEncoder.load(world["root"] / "model").eval(), world["corpus"]
    build_buffer(model, corpus, tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS)
    calls = counting(model)
    assert build_buffer(model, corpus, tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS).rows == ROWS
    assert calls == []  # complete and matching: nothing re-encoded
    other = DualEncoder.from_config(RetrieverConfig(model="tiny", tiny=TINY, projection_dim=16),
                                    str(world["tokenizer"]), seed=1).eval()
    with pytest.raises(BufferError, match="model_fingerprint.*not overwritten"):
        build_buffer(other, corpus, tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS)
    rebuilt = build_buffer(other, corpus, tmp_path / "buf", batch_size=BATCH, shard_rows=20, overwrite=True)
    assert rebuilt.manifest["model_fingerprint"] == vectors_fingerprint(other)
    assert sorted(p.name for p in rebuilt.path.glob("shard-*.npy")) == ["shard-00000.npy", "shard-00001.npy"]


@pytest.mark.parametrize("change", ["pooling", "normalisation", "max-length", "tokenizer"])
def test_a_buffer_of_the_same_weights_encoded_otherwise_is_not_reused(world, tmp_path, change):
    """Same weights (`fingerprint()` equal), other vectors: another pooling, no normalisation, a shorter maximum
    length or another tokenizer (lower-casing added) each change the buffer's fingerprint: not reused."""
    import copy

    from tokenizers import normalizers

    corpus, tokenizer = world["corpus"], str(world["tokenizer"])
    settings = dict(model="tiny", tiny=TINY, projection_dim=16)

    def build(cfg: RetrieverConfig) -> DualEncoder:
        torch.manual_seed(0)  # the projection is drawn from the global generator
        return DualEncoder.from_config(cfg, tokenizer).eval()

    made = build(RetrieverConfig(**settings))
    build_buffer(made, corpus, tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS)
    if change == "tokenizer":
        other = copy.deepcopy(made)
        other.passage_encoder.tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()
    else:
        edit = {"pooling": {"pooling": "cls"}, "normalisation": {"normalize": False},
                "max-length": {"max_passage_length": 8}}[change]
        other = build(RetrieverConfig(**settings, **edit))
    assert other.fingerprint() == made.fingerprint()  # the weights alone cannot tell them apart
    assert not torch.allclose(direct(other, corpus), direct(made, corpus))  # but their vectors differ
    assert vectors_fingerprint(other) != vectors_fingerprint(made)
    with pytest.raises(BufferError, match="model_fingerprint.*not overwritten"):
        build_buffer(other, corpus, tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS)
    again = build(RetrieverConfig(**settings))
    assert vectors_fingerprint(again) == vectors_fingerprint(made)  # reproducible: a matching buffer is reused
    assert build_buffer(again, corpus, tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS).rows == ROWS


@pytest.mark.slow
def test_killed_build_resumes_byte_identical(world, tmp_path):
    clean = build_buffer(world["model"], world["corpus"], tmp_path / "clean", batch_size=BATCH, shard_rows=SHARD_ROWS)
    out = tmp_path / "killed"
    proc = subprocess.run([sys.executable, str(ROOT / "tests/dist/build_killed.py"), str(world["root"] / "model"),
                           str(world["corpus"].path), str(out), str(SHARD_ROWS), str(BATCH)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert list(shard_bytes(out)) == ["shard-00000.npy"]
    with pytest.raises(BufferError, match="interrupted"):
        Buffer.open(out)
    model = DualEncoder.load(world["root"] / "model").eval()
    calls = counting(model)
    resumed = build_buffer(model, world["corpus"], out, batch_size=BATCH, shard_rows=SHARD_ROWS)
    assert sum(calls) == ROWS - SHARD_ROWS  # the finished shard was not re-encoded
    assert shard_bytes(out) == shard_bytes(clean.path)
    assert resumed.manifest["shards"] == clean.manifest["shards"]


def test_resume_re_encodes_a_corrupted_shard(world, tmp_path):
    build_buffer(world["model"], world["corpus"], tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS)
    clean = shard_bytes(tmp_path / "buf")
    manifest = tmp_path / "buf" / "manifest.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), complete=False)))
    (tmp_path / "buf" / "shard-00002.npy").write_bytes(b"garbage")
    model = DualEncoder.load(world["root"] / "model").eval()
    calls = counting(model)
    build_buffer(model, world["corpus"], tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS)
    assert sum(calls) == SHARD_ROWS and shard_bytes(tmp_path / "buf") == clean


@pytest.mark.slow
def test_two_process_build_equals_one_process(world, tmp_path):
    single = build_buffer(world["model"], world["corpus"], tmp_path / "one", batch_size=BATCH, shard_rows=SHARD_ROWS)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # `--cpu --num_processes 2` starts ONE process in accelerate 1.x; the torchrun launcher starts two
    command = launch_command(str(ROOT / "scripts/embed_corpus.py"), f"passages={world['corpus'].path}",
               f"model_dir={world['root'] / 'model'}", f"output={tmp_path / 'two'}",
               f"buffer.shard_rows={SHARD_ROWS}", f"buffer.embed_batch_size={BATCH}", processes=2)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("buffer:") == 1 and "2 process(es)" in proc.stdout  # two ranks, main prints once
    two = Buffer.open(tmp_path / "two", single.manifest["model_fingerprint"], single.manifest["corpus_fingerprint"],
                      verify=True)
    assert two.manifest["shards"] == single.manifest["shards"]
    assert shard_bytes(two.path) == shard_bytes(single.path)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_shard_of_a_complete_buffer_is_named_or_repaired(world, tmp_path):
    """Reusing a complete buffer checks its shards: a flipped byte is an error naming the shard (nothing encoded);
    `repair` re-encodes that shard alone, back to the clean bytes."""
    build_buffer(world["model"], world["corpus"], tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS)
    clean = shard_bytes(tmp_path / "buf")
    flip_byte(tmp_path / "buf" / "shard-00002.npy")
    model = DualEncoder.load(world["root"] / "model").eval()
    calls = counting(model)
    with pytest.raises(BufferError, match=r"shards\[2\].*shard-00002.npy does not match.*1 of 4.*repair=true"):
        build_buffer(model, world["corpus"], tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS, verify=True)
    assert calls == []
    repaired = build_buffer(model, world["corpus"], tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS,
                            repair=True)
    assert sum(calls) == SHARD_ROWS and shard_bytes(tmp_path / "buf") == clean
    repaired.verify()


def test_an_unreadable_manifest_keeps_the_intact_shards(world, tmp_path):
    """A truncated manifest is refused with the way out named; `repair` rebuilds it from the shards' records without
    encoding anything, and refuses when those records are another model's."""
    clean = build_buffer(world["model"], world["corpus"], tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS)
    manifest = tmp_path / "buf" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    model = DualEncoder.load(world["root"] / "model").eval()
    calls = counting(model)
    with pytest.raises(BufferError, match="manifest.json:.*not valid JSON.*repair=true"):
        build_buffer(model, world["corpus"], tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS)
    settings = RetrieverConfig(model="tiny", tiny=TINY, projection_dim=16)
    other = DualEncoder.from_config(settings, str(world["tokenizer"]), seed=1).eval()
    with pytest.raises(BufferError, match="shard-00000.json: field 'model_fingerprint'.*not overwritten"):
        build_buffer(other, world["corpus"], tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS, repair=True)
    repaired = build_buffer(model, world["corpus"], tmp_path / "buf", batch_size=BATCH, shard_rows=SHARD_ROWS,
                            repair=True)
    assert calls == [] and repaired.manifest == clean.manifest


@pytest.mark.parametrize("field, value, expected", [
    ("dim", "abc", "field 'dim': expected an integer, got \"abc\" \\(a string\\)"),
    ("rows", True, "field 'rows': expected an integer, got true"),
    ("complete", "yes", "field 'complete': expected true or false"),
    ("shards", {}, "field 'shards': expected a list"),
])
def test_manifest_field_types_are_checked(tmp_path, field, value, expected):
    Buffer.write(tmp_path / "b", torch.ones(6, 4), shard_rows=4)
    manifest = tmp_path / "b" / "manifest.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), **{field: value})))
    with pytest.raises(BufferError, match=f"{manifest}: {expected}"):
        Buffer.open(tmp_path / "b")


def test_a_shard_field_type_is_checked(tmp_path):
    Buffer.write(tmp_path / "b", torch.ones(6, 4), shard_rows=4)
    manifest = tmp_path / "b" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["shards"][1]["end"] = "6"
    manifest.write_text(json.dumps(data))
    with pytest.raises(BufferError, match=r"field 'shards\[1\].end': expected an integer, got \"6\""):
        Buffer.open(tmp_path / "b")


def test_embed_corpus_script_refuses_then_repairs_a_damaged_buffer(world, tmp_path, zygote):
    """scripts/embed_corpus.py on its own finished buffer with a flipped byte: exit 2 and one line naming the shard;
    with repair=true: exit 0 and the clean bytes."""
    args = ["scripts/embed_corpus.py", f"passages={world['corpus'].path}", f"model_dir={world['root'] / 'model'}",
            f"output={tmp_path / 'buf'}", f"buffer.shard_rows={SHARD_ROWS}", f"buffer.embed_batch_size={BATCH}"]

    def run(*extra: str) -> tuple[object, str]:
        answer = zygote.run({"argv": [*args, *extra], "cwd": str(ROOT), "env": {}, "stdout": str(tmp_path / "out"),
                             "stderr": str(tmp_path / "err")})
        return answer["status"], (tmp_path / "err").read_text()

    assert run()[0] == 0
    clean = shard_bytes(tmp_path / "buf")
    flip_byte(tmp_path / "buf" / "shard-00001.npy")
    status, stderr = run()
    assert status == 2 and "Traceback" not in stderr, stderr[-2000:]
    assert f"error: {tmp_path / 'buf' / 'manifest.json'}: field 'shards[1]': sha256 of " \
           f"{tmp_path / 'buf' / 'shard-00001.npy'} does not match" in stderr
    assert run("repair=true")[0] == 0 and shard_bytes(tmp_path / "buf") == clean


# ---- a stop signal during scripts/embed_corpus.py -----------------------------------------------------------------

STOP_SHARD_ROWS = 4  # 10 shards of one batch each: a shard boundary after the signal, whenever it comes
SLOW = "0.5"  # seconds per encoder batch (tests/dist/embed_slow.py): 4.5 s of shards left when the first is seen


def embed_args(world, out: Path) -> list[str]:
    return [f"passages={world['corpus'].path}", f"model_dir={world['root'] / 'model'}", f"output={out}",
            f"buffer.shard_rows={STOP_SHARD_ROWS}", f"buffer.embed_batch_size={BATCH}"]


def embed_in_zygote(zygote, world, out: Path, script: str = "scripts/embed_corpus.py",
                    **env: str) -> tuple[object, str, str]:
    """`script` (scripts/embed_corpus.py or tests/dist/embed_slow.py) into `out`, forked from the zygote with `env`:
    (status, stdout, stderr)."""
    logs = {name: out.parent / f"{out.name}.{name}" for name in ("stdout", "stderr")}
    answer = zygote.run({"argv": [script, *embed_args(world, out)], "cwd": str(ROOT), "env": env,
                         **{name: str(path) for name, path in logs.items()}})
    return answer["status"], logs["stdout"].read_text(), logs["stderr"].read_text()


def folder_bytes(directory: Path) -> dict[str, bytes]:
    """Every file of a buffer folder (shards, their records, the manifest; a lock file if one were left)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def uninterrupted(world, tmp_path_factory, zygote) -> dict[str, bytes]:
    """The buffer of an uninterrupted scripts/embed_corpus.py run (10 shards), file by file."""
    out = tmp_path_factory.mktemp("embed-uninterrupted") / "buf"
    status, _, stderr = embed_in_zygote(zygote, world, out)
    assert status == 0, stderr[-2000:]
    return folder_bytes(out)


def wait_for(condition, done, what: str, timeout: float = 180) -> None:
    """Poll `condition` until it holds; fail if `done()` (the build ended first) or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if done() or time.monotonic() > deadline:
            pytest.fail(f"the build ended, or {timeout} s passed, before {what}")
        time.sleep(0.01)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the stopped build hung:\n{stderr[-3000:]}")


def stopped_lines(stderr: str, out: Path) -> list[tuple[str, int]]:
    """(rank prefix and who, shards written) of each `stopped by ...` line (another rank's progress bar may have
    left its last redraw in front of it on the launcher's shared stderr)."""
    pattern = (rf"((?:\[rank \d\] )?stopped by [^:]+): (\d+) of 10 shards of {re.escape(str(out))} are written, "
               r"each with its record, and kept; run the same command again to embed the other (\d+) and finish the "
               r"buffer$")
    found = [re.search(pattern, line) for line in stderr.splitlines() if "stopped by" in line]
    assert found and all(found), stderr[-3000:]
    assert all(int(m[2]) + int(m[3]) == 10 for m in found)
    return [(m[1], int(m[2])) for m in found]


@pytest.mark.parametrize("name", ["TERM", "USR1"])
def test_a_stop_signal_ends_embed_corpus_at_a_shard_boundary_and_the_rerun_is_byte_identical(
        world, tmp_path, zygote, uninterrupted, name):
    """SIGTERM / SIGUSR1 from outside once the first shard is on disk: the shard being encoded is finished, the
    build stops before the next (shards left to do), one line says so and how to resume, exit 6, every finished
    shard and its record kept; the same command again encodes only the rest and leaves the uninterrupted run's
    files byte for byte (the manifest holds nothing time-dependent)."""
    out, pids = tmp_path / "buf", tmp_path / "pids"
    pids.mkdir()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the build, forked from the zygote, in the background
        build = pool.submit(embed_in_zygote, zygote, world, out, "tests/dist/embed_slow.py", EMBED_SLEEP=SLOW,
                            EMBED_PID_DIR=str(pids))
        wait_for(lambda: (out / "shard-00000.json").is_file() and (pids / "rank0.pid").is_file(), build.done,
                 "the first shard")
        os.kill(int((pids / "rank0.pid").read_text()), getattr(signal, f"SIG{name}"))
        status, _, stderr = build.result()
    assert status == PREEMPTED_EXIT and "Traceback" not in stderr and "error:" not in stderr, stderr[-3000:]
    [(who, written)] = stopped_lines(stderr, out)
    assert who == f"stopped by SIG{name}" and 1 <= written < 10
    records = sorted(p.name for p in out.glob("shard-*.json"))
    assert records == [f"shard-{i:05d}.json" for i in range(written)]
    assert sorted(p.name for p in out.glob("shard-*.npy")) == [r.replace(".json", ".npy") for r in records]
    assert all(folder_bytes(out)[r] == uninterrupted[r] for r in records)  # durable and final already
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    assert not (out / ".lock").exists()

    status, stdout, stderr = embed_in_zygote(zygote, world, out)
    assert status == 0, stderr[-3000:]
    assert f"stale buffer build: {ROWS - written * STOP_SHARD_ROWS} rows" in stdout  # only the shards left
    assert folder_bytes(out) == uninterrupted


@pytest.mark.slow
def test_a_stop_signal_to_one_of_two_embedding_processes_stops_both_and_the_rerun_is_byte_identical(
        world, tmp_path, uninterrupted):
    """SIGTERM to rank 1 only (shards 5-9) once its first shard is on disk: both ranks agree at the next shard
    boundary (one all-reduce per shard), each prints its line and exits 6, rank 1 waiting for rank 0 although rank
    0 ends 2 s later with the usual signal handlers back (the launcher stops the other ranks when one exits
    non-zero: before `end_process` waited, that killed rank 0 before its line in a CI run); the
    two-process rerun finishes the buffer byte for byte as the uninterrupted one-process run."""
    out, pids = tmp_path / "buf", tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", EMBED_SLEEP=SLOW, EMBED_PID_DIR=str(pids),
               EMBED_RANK0_END_DELAY="2")
    proc = subprocess.Popen(launch_command(ROOT / "tests/dist/embed_slow.py", *embed_args(world, out), processes=2),
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    wait_for(lambda: (out / "shard-00005.json").is_file() and (pids / "rank1.pid").is_file(),
             lambda: proc.poll() is not None, "the first shard of rank 1")
    os.kill(int((pids / "rank1.pid").read_text()), signal.SIGTERM)
    _, stderr = finish(proc)
    assert proc.returncode != 0, stderr[-3000:]
    assert "Traceback" not in stderr.split("failed (exitcode")[0], stderr[-3000:]  # the launcher's own comes after
    lines = dict(stopped_lines(stderr, out))
    assert set(lines) == {"[rank 1] stopped by SIGTERM", "[rank 0] stopped by a stop signal sent to another process"}
    written = lines["[rank 0] stopped by a stop signal sent to another process"]
    assert lines["[rank 1] stopped by SIGTERM"] == written and written % 2 == 0 and 2 <= written < 10
    assert "exitcode  : 6" in stderr.split("Root Cause (first observed failure):")[1], stderr[-3000:]
    half = written // 2  # both ranks stopped after the same round
    assert sorted(p.name for p in out.glob("shard-*.json")) == [f"shard-{i:05d}.json" for i in
                                                               [*range(half), *range(5, 5 + half)]]

    rerun = launch_command(ROOT / "scripts/embed_corpus.py", *embed_args(world, out), processes=2)
    proc = subprocess.run(rerun, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert folder_bytes(out) == uninterrupted

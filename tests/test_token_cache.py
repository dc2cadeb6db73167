"""The token cache (buffer/tokens.py): its ids against the HF tokenizer's own call on each passage; a cache of another
corpus / tokenizer / max length refused naming the field; a killed build, and one stopped by a stop signal (on one of
two processes: both stop at the same shard), resumed to the bytes of an uninterrupted one; 0 and 2 workers give the
same bytes; corpus passes from cached ids give the bytes of passes that tokenise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import rag_train.buffer.tokens as tokens_module
from rag_train.buffer.embed import WORKER_MIN_BATCHES, PassageTokenizer, embed_rows, use_token_cache
from rag_train.buffer.tokens import TokenCache, TokenCacheError, build_token_cache, finished_token_cache
from rag_train.config import RetrieverConfig
from rag_train.io import sha256_file
from rag_train.launch import launch_command
from rag_train.models.retriever import DualEncoder, format_passage
from rag_train.preemption import Preempted, StopSignal

from test_embed import MAX_LENGTH, TINY, write_corpus

ROOT = Path(__file__).resolve().parents[1]
SHARD_ROWS = 16  # 60 rows: shards of 16, 16, 16, 12
STARTS = [0, 16, 32, 48]  # the first row of each shard


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_world):
    root = tmp_path_factory.mktemp("token-cache")
    corpus = write_corpus(root / "passages.jsonl")
    cfg = RetrieverConfig(model="tiny", tiny=TINY, projection_dim=16, max_passage_length=MAX_LENGTH)
    model = DualEncoder.from_config(cfg, str(toy_world["tokenizer"])).eval()
    return corpus, model, PassageTokenizer.for_passages(model), toy_world["tokenizer"]


def folder_bytes(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_cache_ids_equal_the_tokenizers_own_call(world, tmp_path):
    corpus, _, tokenizer, tokenizer_dir = world
    cache = build_token_cache(corpus, tokenizer, tmp_path / "tokens", shard_rows=SHARD_ROWS)
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    texts = [format_passage(p) for p in corpus.passages(range(len(corpus)))]
    theirs = [hf(text, truncation=True, max_length=MAX_LENGTH)["input_ids"] for text in texts]
    assert cache.manifest["dtype"] == "uint16" and len(cache.manifest["shards"]) == 4
    assert [cache.ids(row).tolist() for row in range(len(corpus))] == theirs
    assert max(map(len, theirs)) == MAX_LENGTH and min(map(len, theirs)) < MAX_LENGTH  # truncated and padded rows
    rows = np.array([59, 0, 17, 17, 33])  # across shards, repeated
    padded = cache.padded(rows, pad_id=-1)
    for line, row in zip(padded.tolist(), rows):
        assert line == theirs[row] + [-1] * (padded.shape[1] - len(theirs[row]))
    assert cache.lengths(rows).tolist() == [len(theirs[row]) for row in rows]


def test_a_cache_of_another_corpus_tokenizer_or_max_length_is_refused(world, tmp_path):
    corpus, model, tokenizer, tokenizer_dir = world
    folder = tmp_path / "tokens"
    build_token_cache(corpus, tokenizer, folder, shard_rows=SHARD_ROWS)
    before = folder_bytes(folder)
    other_corpus = write_corpus(tmp_path / "other.jsonl", rows=50)
    longer = PassageTokenizer(model.passage_encoder[0].tokenizer, MAX_LENGTH + 8)
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hf.add_tokens(["zzyzx"])
    other_tokenizer = PassageTokenizer(hf, MAX_LENGTH)
    manifest = folder / "manifest.json"
    for what, args, field in [("corpus", (other_corpus, tokenizer), "corpus_fingerprint"),
                              ("tokenizer", (corpus, other_tokenizer), "tokenizer_fingerprint"),
                              ("max length", (corpus, longer), "max_length")]:
        for attempt in (lambda: build_token_cache(*args, folder, shard_rows=SHARD_ROWS),
                        lambda: TokenCache.open(folder, *args)):
            with pytest.raises(TokenCacheError, match=f"^{manifest}: field '{field}': .*another") as raised:
                attempt()
            assert field in str(raised.value), what
    assert folder_bytes(folder) == before  # nothing overwritten
    cache = TokenCache.open(folder, corpus, tokenizer)
    with pytest.raises(TokenCacheError, match="field 'max_length'"):  # handed to a pass of another max length
        embed_rows(DualEncoder.from_config(RetrieverConfig(model="tiny", tiny=TINY, projection_dim=16,
                                                           max_passage_length=MAX_LENGTH + 8),
                                           str(tokenizer_dir)), corpus, np.arange(4), 4, torch.device("cpu"),
                   tokens=cache)
    rebuilt = build_token_cache(corpus, longer, folder, shard_rows=SHARD_ROWS, overwrite=True)
    assert rebuilt.manifest["max_length"] == MAX_LENGTH + 8


def test_a_killed_build_resumes_to_the_bytes_of_an_uninterrupted_one(world, tmp_path, monkeypatch):
    corpus, _, tokenizer, _ = world
    build_token_cache(corpus, tokenizer, tmp_path / "straight", shard_rows=SHARD_ROWS)
    tokenize = tokens_module.tokenize_rows
    calls = []

    def dies_at_the_third_shard(corpus, tokenizer, start, end, *args):
        calls.append(start)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return tokenize(corpus, tokenizer, start, end, *args)

    monkeypatch.setattr(tokens_module, "tokenize_rows", dies_at_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        build_token_cache(corpus, tokenizer, tmp_path / "killed", shard_rows=SHARD_ROWS)
    assert json.loads((tmp_path / "killed" / "manifest.json").read_text())["complete"] is False
    with pytest.raises(TokenCacheError, match="field 'complete': false"):
        TokenCache.open(tmp_path / "killed")
    calls.clear()
    build_token_cache(corpus, tokenizer, tmp_path / "killed", shard_rows=SHARD_ROWS)
    assert calls == [32, 48]  # only the shards not written before the kill
    assert folder_bytes(tmp_path / "killed") == folder_bytes(tmp_path / "straight")


def stopped_message(who: str, folder, written: int, shards: int) -> str:
    return (f"stopped by {who}: {written} of {shards} token-cache shards of {folder} are written, each with its "
            f"record, and kept; run the same command again to tokenise the other {shards - written} and finish the "
            "token cache")


@pytest.mark.parametrize("k", [0, 2])
def test_a_stop_signal_ends_the_build_before_shard_k_and_the_same_call_resumes(world, tmp_path, monkeypatch, k):
    """A stop signal noted while shard k-1 is tokenised (before the build, for k=0): the build stops before shard k
    with Preempted saying how many shards are kept, shards 0..k-1 written as the uninterrupted build's and matching
    their records, the manifest not complete; the same call without a stop tokenises only shards k.. and leaves the
    uninterrupted build's bytes."""
    corpus, _, tokenizer, _ = world
    straight = build_token_cache(corpus, tokenizer, tmp_path / "straight", shard_rows=SHARD_ROWS)
    tokenize, calls, stop = tokens_module.tokenize_rows, [], StopSignal()

    def signalled_in_shard_k_minus_1(corpus, tokenizer, start, end, *args):
        calls.append(start)
        if len(calls) == k and stop.received is None:  # once: a second signal is obeyed at once
            stop._note(signal.SIGTERM, None)  # what the handler does when the signal arrives
        return tokenize(corpus, tokenizer, start, end, *args)

    monkeypatch.setattr(tokens_module, "tokenize_rows", signalled_in_shard_k_minus_1)
    folder = tmp_path / "stopped"
    try:
        if k == 0:
            stop._note(signal.SIGTERM, None)
        with pytest.raises(Preempted) as raised:
            build_token_cache(corpus, tokenizer, folder, shard_rows=SHARD_ROWS, stop=stop)
    finally:
        stop.restore()
    assert str(raised.value) == stopped_message("SIGTERM", folder, k, len(STARTS))
    assert calls == STARTS[:k]
    written = [f"{kind}-{i:05d}.{ext}" for i in range(k) for kind, ext in
               (("ids", "json"), ("ids", "npy"), ("offsets", "npy"))]
    assert sorted(folder_bytes(folder)) == sorted(written + ["manifest.json"])
    assert all(folder_bytes(folder)[name] == folder_bytes(straight.path)[name] for name in written)
    for i in range(k):
        record = json.loads((folder / f"ids-{i:05d}.json").read_text())
        assert all(sha256_file(folder / record[key]) == record[f"{key}_sha256"] for key in ("ids", "offsets"))
    assert json.loads((folder / "manifest.json").read_text())["complete"] is False
    assert finished_token_cache(folder) is None

    calls.clear()
    resumed = build_token_cache(corpus, tokenizer, folder, shard_rows=SHARD_ROWS)
    assert calls == STARTS[k:]  # only the shards the stopped build left
    assert resumed.manifest == straight.manifest
    rows = np.arange(len(corpus))
    assert np.array_equal(resumed.padded(rows, -1), straight.padded(rows, -1))
    assert folder_bytes(folder) == folder_bytes(straight.path)  # ids, offsets, records and manifest


@pytest.mark.slow
def test_a_stop_signal_to_one_of_two_processes_stops_both_at_the_same_shard(world, tmp_path):
    """tests/dist/tokens_stopped.py: 5 shards (rank 0: 0-1, rank 1: 2-4); a SIGTERM to rank 1 in its first shard
    stops both processes before their second (shards 0 and 2 kept), one in its next shard stops both again although
    rank 0 has no shard left (it takes part in the check: the two all-reduces pair up), and the build without a stop
    tokenises only shard 4 and leaves the bytes of a one-process build."""
    corpus, _, _, tokenizer_dir = world
    tokenizer = PassageTokenizer(AutoTokenizer.from_pretrained(str(tokenizer_dir)), MAX_LENGTH)
    one = build_token_cache(corpus, tokenizer, tmp_path / "one", shard_rows=12)
    out = tmp_path / "two"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = launch_command(ROOT / "tests/dist/tokens_stopped.py", corpus.path, tokenizer_dir, MAX_LENGTH, 12, out,
                             processes=2)
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, (who, tokenised) in enumerate([("a stop signal sent to another process", [[0], [12], []]),
                                             ("SIGTERM", [[24], [36], [48]])]):
        assert [build["stopped"] for build in ranks[rank]] == [stopped_message(who, out, 2, 5),
                                                              stopped_message(who, out, 4, 5), None]
        assert [build["tokenised"] for build in ranks[rank]] == tokenised
        assert [build["records"] for build in ranks[rank]] == [[f"ids-{i:05d}.json" for i in shards]
                                                               for shards in ([0, 2], [0, 1, 2, 3], range(5))]
        assert [build["complete"] for build in ranks[rank]] == [False, False, True]
    assert folder_bytes(out) == folder_bytes(one.path)


def test_the_callers_pass_their_stop_signal(world, tmp_path):
    """scripts/embed_corpus.py's work stops in the token cache, before the buffer (no shard of it written), and the
    same call finishes both; a training run's token cache and buffer stop with the run's stop signal, their line
    saying how the run resumes, and the resumed build gives embed_corpus's buffer."""
    from contextlib import ExitStack
    from types import SimpleNamespace

    from rag_train.buffer.store import Buffer
    from rag_train.config import BufferConfig
    from rag_train.serving.embed_corpus import EmbedConfig, embed_corpus
    from rag_train.train.passages import ensure_buffer, ensure_token_cache

    corpus, model, _, _ = world
    model.save(tmp_path / "model")
    out = tmp_path / "buffer"
    cfg = EmbedConfig(passages=str(corpus.path), model_dir=str(tmp_path / "model"), output=str(out),
                      buffer=BufferConfig(shard_rows=SHARD_ROWS, embed_batch_size=8))
    stop = StopSignal()
    try:
        stop._note(signal.SIGTERM, None)  # what the handler does when the signal arrives
        with pytest.raises(Preempted) as raised:
            embed_corpus(cfg, stop=stop)
        assert str(raised.value) == stopped_message("SIGTERM", tmp_path / "buffer.tokens", 0, len(STARTS))
        assert not out.exists()
        run = SimpleNamespace(dir=tmp_path / "run", accelerator=None, passes=None, stop_signal=stop,
                              registered=ExitStack())
        with pytest.raises(Preempted) as raised:
            ensure_token_cache(run, BufferConfig(shard_rows=SHARD_ROWS), model, corpus)
        assert str(raised.value) == (stopped_message("SIGTERM", tmp_path / "run" / "buffer.tokens", 0, len(STARTS))
                                     + " (a training run: with train.resume=true)")
        run = SimpleNamespace(dir=tmp_path / "built", accelerator=None, passes=None, stop_signal=stop,
                              latest_checkpoint=lambda: None, agree=lambda **_: None, check_buffer=lambda _: None)
        with pytest.raises(Preempted) as raised:  # the buffer of a training run: stopped before its first shard
            ensure_buffer(run, BufferConfig(shard_rows=SHARD_ROWS, embed_batch_size=8, verify=False), model, corpus)
        assert str(raised.value).startswith("stopped by SIGTERM: 0 of ")
        assert str(raised.value).endswith(" (a training run: with train.resume=true)")
        assert not list((tmp_path / "built" / "buffer").glob("shard-*"))
    finally:
        stop.restore()
    assert embed_corpus(cfg).rows == len(corpus)
    assert finished_token_cache(tmp_path / "buffer.tokens").rows == len(corpus)
    run.stop_signal = StopSignal()  # none arrived: the resumed run's build finishes the buffer
    try:
        ensure_buffer(run, BufferConfig(shard_rows=SHARD_ROWS, embed_batch_size=8, verify=False), model, corpus)
    finally:
        run.stop_signal.restore()
    assert np.array_equal(Buffer.open(tmp_path / "built" / "buffer").array(), Buffer.open(out).array())


def test_workers_0_and_2_give_the_same_bytes(world, tmp_path, monkeypatch):
    corpus, _, tokenizer, _ = world
    monkeypatch.setattr(tokens_module, "ROWS_PER_ITEM", 5)  # several items per shard, for both workers
    build_token_cache(corpus, tokenizer, tmp_path / "in-process", shard_rows=SHARD_ROWS * 2, num_workers=0)
    build_token_cache(corpus, tokenizer, tmp_path / "workers", shard_rows=SHARD_ROWS * 2, num_workers=2)
    assert folder_bytes(tmp_path / "in-process") == folder_bytes(tmp_path / "workers")


def test_one_worker_or_one_piece_tokenises_in_this_process(world, tmp_path, monkeypatch):
    """No worker process is started for fewer than two workers' worth of pieces (this process would only wait for
    it); two workers over several pieces start them."""
    import multiprocessing.process

    corpus, _, tokenizer, _ = world
    started = []
    start = multiprocessing.process.BaseProcess.start
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                        lambda self: (started.append(self.name), start(self))[1])
    build_token_cache(corpus, tokenizer, tmp_path / "one-worker", shard_rows=SHARD_ROWS, num_workers=1)
    build_token_cache(corpus, tokenizer, tmp_path / "one-piece", shard_rows=SHARD_ROWS, num_workers=4)
    assert started == []  # ROWS_PER_ITEM rows per piece: every 16-row shard is one piece
    monkeypatch.setattr(tokens_module, "ROWS_PER_ITEM", 5)
    build_token_cache(corpus, tokenizer, tmp_path / "two-workers", shard_rows=SHARD_ROWS, num_workers=2)
    assert len(started) == 2 * 4  # two per shard, four shards
    assert folder_bytes(tmp_path / "one-worker") == folder_bytes(tmp_path / "two-workers")


def test_passes_from_cached_ids_give_the_bytes_of_passes_that_tokenise(world, tmp_path, monkeypatch):
    """Rows unsorted and repeated, enough for the chunked plan (and workers on the tokenising side); the cache handed
    over or registered; with it no passage is tokenised."""
    corpus, model, tokenizer, _ = world
    cache = build_token_cache(corpus, tokenizer, tmp_path / "tokens", shard_rows=SHARD_ROWS)
    rows = np.random.default_rng(2).integers(0, len(corpus), size=WORKER_MIN_BATCHES * 4 + 10)
    tokenised = embed_rows(model, corpus, rows, 4, torch.device("cpu"), num_workers=0)
    in_workers = embed_rows(model, corpus, rows, 4, torch.device("cpu"), num_workers=2)
    whole = embed_rows(model, corpus, np.arange(len(corpus)), 8, torch.device("cpu"), batch_tokens=100)

    def no_tokenising(*_):
        raise AssertionError("a pass with a token cache tokenised")

    monkeypatch.setattr(PassageTokenizer, "encode", no_tokenising)
    assert torch.equal(embed_rows(model, corpus, rows, 4, torch.device("cpu"), num_workers=0, tokens=cache), tokenised)
    with use_token_cache(cache):
        assert torch.equal(embed_rows(model, corpus, rows, 4, torch.device("cpu"), num_workers=2), in_workers)
        assert torch.equal(embed_rows(model, corpus, np.arange(len(corpus)), 8, torch.device("cpu"),
                                      batch_tokens=100), whole)
    with pytest.raises(AssertionError, match="tokenised"):  # unregistered again: this pass would tokenise
        embed_rows(model, corpus, rows[:3], 4, torch.device("cpu"))


def test_a_registered_cache_of_another_max_length_is_passed_over(world, tmp_path, monkeypatch):
    """A pass matches a registered cache by corpus, tokenizer and max length; otherwise it tokenises, and the cache of
    an unfinished build is not offered at all."""
    corpus, model, _, _ = world
    longer = PassageTokenizer(model.passage_encoder[0].tokenizer, MAX_LENGTH + 8)
    cache = build_token_cache(corpus, longer, tmp_path / "tokens", shard_rows=SHARD_ROWS)
    tokenised = embed_rows(model, corpus, np.arange(10), 4, torch.device("cpu"))
    encode, calls = PassageTokenizer.encode, []
    monkeypatch.setattr(PassageTokenizer, "encode", lambda self, texts: calls.append(len(texts)) or encode(self, texts))
    with use_token_cache(cache):
        assert torch.equal(embed_rows(model, corpus, np.arange(10), 4, torch.device("cpu")), tokenised)
    assert calls == [10]
    assert finished_token_cache(tmp_path / "tokens").manifest == cache.manifest
    manifest = json.loads((tmp_path / "tokens" / "manifest.json").read_text())
    (tmp_path / "tokens" / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    assert finished_token_cache(tmp_path / "tokens") is None and finished_token_cache(tmp_path / "none") is None


def test_the_fault_matrixs_integrity_check_reads_the_token_caches_records(world, tmp_path):
    """tests/fault_matrix.py's `integrity()`, which every fault cell's output must pass, checks each token-cache shard
    against its record: nothing on a built cache; an ids file changed by one byte and a removed offsets file are
    named."""
    import fault_matrix

    corpus, _, tokenizer, _ = world
    folder = tmp_path / "run" / "buffer.tokens"
    build_token_cache(corpus, tokenizer, folder, shard_rows=SHARD_ROWS)
    assert fault_matrix.integrity(tmp_path / "run") == []
    changed, removed = folder / "ids-00001.npy", folder / "offsets-00002.npy"
    data = bytearray(changed.read_bytes())
    data[-1] ^= 1
    changed.write_bytes(bytes(data))
    removed.unlink()
    assert sorted(fault_matrix.integrity(tmp_path / "run")) == sorted(
        [f"{changed}: missing or not what {folder / 'ids-00001.json'} records",
         f"{removed}: missing or not what {folder / 'ids-00002.json'} records"])

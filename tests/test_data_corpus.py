"""Corpus: every fixture format round-trips, malformed lines are named precisely, the index is cached
and invalidated correctly, and random access over a 200k-row file matches the source lines."""

import csv
import hashlib
import json
import os
import pickle
import random
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from rag_train.data import corpus as corpus_module
from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError

FIXTURES = Path(__file__).parent / "fixtures"


def _reference_jsonl(path):
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        out.append({"id": str(rec.get("id", rec.get("_id"))), "title": rec.get("title") or "", "text": rec["text"]})
    return out


def _reference_dpr_tsv(path):
    with open(path, encoding="utf-8", newline="") as handle:
        return [{"id": r["id"], "title": r["title"], "text": r["text"]} for r in csv.DictReader(handle, delimiter="\t")]


def _reference_msmarco(path):
    rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
    return [{"id": pid, "title": "", "text": text} for pid, text in rows]


@pytest.mark.parametrize("name, reference", [
    ("passages.jsonl", _reference_jsonl),
    ("beir/corpus.jsonl", _reference_jsonl),
    ("psgs_w100.tsv", _reference_dpr_tsv),
    ("msmarco/collection.tsv", _reference_msmarco),
])
def test_fixture_round_trip(tmp_path, name, reference):
    path = FIXTURES / name
    corpus = Corpus.open(path, cache_dir=tmp_path)
    expected = reference(path)
    assert len(corpus) == len(expected)
    assert corpus.passages(range(len(corpus))) == expected
    assert [corpus.id(r) for r in range(len(corpus))] == [p["id"] for p in expected]
    ids = [p["id"] for p in expected]
    assert corpus.rows(ids[::-1]).tolist() == list(range(len(ids)))[::-1]
    assert corpus.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not (path.parent / f"{path.name}.index").exists(), "cache_dir given: nothing may be written beside"


def test_fixture_details(tmp_path):
    dpr = Corpus.open(FIXTURES / "psgs_w100.tsv", cache_dir=tmp_path)
    assert dpr.text(0) == 'Aaron Aaron ( or ; "Ahärôn") is a prophet, high priest, and the brother of Moses.'
    assert dpr.title(0) == "Aaron"
    marco = Corpus.open(FIXTURES / "msmarco/collection.tsv", cache_dir=tmp_path)
    assert marco.text(2).startswith('"Quoted" start')  # MS MARCO has no csv quoting
    jsonl = Corpus.open(FIXTURES / "passages.jsonl", cache_dir=tmp_path)
    assert jsonl.row(8) == 7 and jsonl.row("8") == 7 and jsonl.title(6) == ""
    with pytest.raises(DataError, match=r"unknown passage id 'nope'"):
        jsonl.row("nope")
    with pytest.raises(DataError, match=r"unknown passage id 'p1-but-longer-than-any-id'"):
        jsonl.rows(["p1", "p1-but-longer-than-any-id"])
    with pytest.raises(IndexError):
        jsonl.text(len(jsonl))
    assert jsonl.rows([]).dtype == np.int64


BAD_INPUTS = [
    # (file name, content, line, field)
    ("bad.jsonl", '{"id": "a", "text": "x"}\n{"id": "b", "text": \n', 2, None),
    ("noid.jsonl", '{"id": "a", "text": "x"}\n{"title": "t", "text": "y"}\n', 2, "id"),
    ("emptyid.jsonl", '{"id": "a", "text": "x"}\n{"id": "a2", "text": "x"}\n{"id": "  ", "text": "y"}\n', 3, "id"),
    ("notext.jsonl", '{"id": "a", "title": "t"}\n', 1, "text"),
    ("listline.jsonl", '{"id": "a", "text": "x"}\n["a", "x"]\n', 2, None),
    ("badtitle.jsonl", '{"id": "a", "text": "x", "title": 3}\n', 1, "title"),
    ("dup.jsonl", '{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "a", "text": "z"}\n', 3, "id"),
    ("dup.tsv", "id\ttext\ttitle\n7\tx\tt\n8\ty\tt\n8\tz\tt\n", 4, "id"),
    ("short.tsv", "id\ttext\ttitle\n1\tx\tt\n2\n", 3, "text"),
    ("quote.tsv", 'id\ttext\ttitle\n1\t"unclosed\tt\n', 2, None),
    ("emptyid.tsv", "1\tx\n\ty\n", 2, "id"),
]


@pytest.mark.parametrize("name, content, line, field", BAD_INPUTS)
def test_malformed_lines_name_file_line_field(tmp_path, name, content, line, field):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as info:
        Corpus.open(path)
    message = str(info.value)
    assert f"{name}:{line}:" in message
    if field is not None:
        assert f"field '{field}'" in message
    assert not (tmp_path / f"{name}.index" / "meta.json").exists()


def test_duplicate_names_first_line(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "a", "text": "z"}\n')
    with pytest.raises(DataError, match=r"duplicate passage id 'a' \(first seen on line 1\)"):
        Corpus.open(path)


@pytest.mark.parametrize("name, content", [
    ("spaces.jsonl", '{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "a ", "text": "z"}\n'),
    ("spaces.tsv", "id\ttext\ttitle\na\tx\tA\nb\ty\tB\n a\tz\tC\n"),
])
def test_ids_differing_only_by_surrounding_whitespace_are_one_id(tmp_path, name, content):
    """Ids are stripped when read: "a " and " a" are "a", so a second one is the duplicate-id error naming both
    lines; a lone padded id is found by its stripped form."""
    path = tmp_path / name
    path.write_text(content)
    first = 1 if name.endswith("jsonl") else 2  # the TSV has a header line
    with pytest.raises(DataError, match=rf"{name}:{first + 2}: field 'id': duplicate passage id 'a' \(first seen on "
                                        rf"line {first}\)"):
        Corpus.open(path)
    path.write_text(content.replace("a ", "c ").replace(" a\t", " c\t"))
    corpus = Corpus.open(path)
    assert corpus.id(2) == "c" and corpus.row("c") == 2 and corpus.row(" c ") == 2 and corpus.passage(2)["id"] == "c"


def test_blank_passages_are_counted_and_warned_about(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "  "}\n{"id": "c", "text": ""}\n')
    for _ in range(2):  # when the index is built and when it is reused
        with pytest.warns(corpus_module.BlankPassagesWarning, match=r"blank.jsonl: 2 passage\(s\) with blank text "
                                                                    r"\(the first: id 'b'\)"):
            assert len(Corpus.open(path)) == 3


def test_non_utf8_and_empty_and_compressed(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"id": "a", "text": "x"}\n{"id": "b", "text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not valid UTF-8"):
        Corpus.open(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no passages"):
        Corpus.open(empty)
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(b"\x1f\x8b")
    with pytest.raises(DataError, match=r"p\.jsonl\.gz: .*decompress"):
        Corpus.open(gz)
    with pytest.raises(DataError, match="not found"):
        Corpus.open(tmp_path / "missing.jsonl")


def test_index_cache_reuse_and_invalidation(tmp_path, monkeypatch):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": "two"}\n')
    first = Corpus.open(path)
    assert (tmp_path / "p.jsonl.index" / "meta.json").is_file()
    builds = []
    real_build = corpus_module._build_index
    monkeypatch.setattr(corpus_module, "_build_index", lambda *a: (builds.append(a), real_build(*a)))
    again = Corpus.open(path)
    assert builds == [] and again.fingerprint == first.fingerprint

    with open(path, "a") as handle:  # size changes
        handle.write('{"id": "c", "text": "three"}\n')
    grown = Corpus.open(path)
    assert len(builds) == 1 and len(grown) == 3 and grown.text(grown.row("c")) == "three"

    stat = path.stat()  # same size, new content and mtime
    path.write_text(path.read_text().replace("one", "uno"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    edited = Corpus.open(path)
    assert len(builds) == 2 and edited.text(0) == "uno" and edited.fingerprint != grown.fingerprint


def test_index_in_cache_dir_and_pickle(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    path = source / "p.tsv"
    path.write_text("id\ttext\ttitle\n1\thello\tH\n2\tworld\tW\n")
    cache = tmp_path / "cache"
    corpus = Corpus.open(path, cache_dir=cache)
    assert list(source.iterdir()) == [path]
    assert corpus.index_dir.parent == cache and (corpus.index_dir / "meta.json").is_file()
    blob = pickle.dumps(corpus)
    assert len(blob) < 1000, "pickling must not copy the memmapped index"
    clone = pickle.loads(blob)
    assert clone.passages([1, 0]) == corpus.passages([1, 0])


def _write_big_corpus(path, rows, rng):
    """A JSONL corpus with variable-length, shuffled ids and random texts; returns its lines."""
    ids = [f"doc-{i * 7919 % 1000003}-{'x' * (i % 5)}" for i in range(rows)]
    rng.shuffle(ids)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "東京", "theta"]
    lines = [json.dumps({"id": pid, "title": f"T{i}", "text": " ".join(rng.choices(words, k=rng.randint(1, 30)))},
                        ensure_ascii=False) for i, pid in enumerate(ids)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines


def test_200k_rows_random_access_with_flat_memory(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "big.jsonl"
    lines = _write_big_corpus(path, 200_000, rng)
    size = path.stat().st_size

    tracemalloc.start()
    corpus = Corpus.open(path)
    build_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(corpus) == len(lines)
    # The build keeps offsets and ids only (about 30 bytes a row), never the text of the file.
    assert build_peak < size / 2, (build_peak, size)

    del corpus
    tracemalloc.start()
    corpus = Corpus.open(path)
    sample = rng.sample(range(len(lines)), 3000)
    for row in sample:
        expected = json.loads(lines[row])
        assert corpus.passage(row) == expected
        assert corpus.id(row) == expected["id"]
    open_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert open_peak < size / 20, (open_peak, size)  # memmapped: nothing proportional to the corpus

    sample_ids = [json.loads(lines[r])["id"] for r in sample]
    assert corpus.rows(sample_ids).tolist() == sample
    assert corpus.row(sample_ids[0]) == sample[0]
    lengths = corpus.byte_lengths()
    assert lengths[sample[0]] == len(lines[sample[0]].encode()) + 1


def test_read_only_directory_falls_back_to_cache(tmp_path, monkeypatch):
    source = tmp_path / "ro"
    source.mkdir()
    path = source / "p.jsonl"
    shutil.copy(FIXTURES / "passages.jsonl", path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    real_access = os.access
    monkeypatch.setattr(corpus_module.os, "access",
                        lambda p, mode: False if Path(p) == source else real_access(p, mode))
    corpus = Corpus.open(path)
    assert list(source.iterdir()) == [path]
    assert str(corpus.index_dir).startswith(str(tmp_path / "xdg" / "rag_train" / "corpus-index"))
    assert corpus.passage(0)["id"] == "p1"

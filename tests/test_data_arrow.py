"""Parquet files and datasets.save_to_disk folders as passages, QA sets and BEIR queries: the same rows as the
JSONL reader, memory-mapped, the same index caching and fingerprint rules, and malformed tables named by
file, row and field."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rag_train.data import corpus as corpus_module
from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError
from rag_train.data.qa import load_qa
from rag_train.data.supervised import load_retrieval

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def _quiet():
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _save(tmp_path: Path, name: str, columns: dict, fmt: str) -> Path:
    table = pa.table(columns)
    if fmt == "parquet":
        pq.write_table(table, tmp_path / f"{name}.parquet")
        return tmp_path / f"{name}.parquet"
    datasets.Dataset(table).save_to_disk(str(tmp_path / name))
    return tmp_path / name


def _columns(records: list[dict], id_key: str) -> dict:
    return {id_key: [str(r.get("id", r.get("_id"))) for r in records],  # one type per column
            "title": [r.get("title") for r in records], "text": [r["text"] for r in records]}


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
@pytest.mark.parametrize("fixture, id_key", [("passages.jsonl", "id"), ("beir/corpus.jsonl", "_id")])
def test_same_passages_as_the_jsonl_reader(tmp_path, fmt, fixture, id_key):
    source = FIXTURES / fixture
    reference = Corpus.open(source, cache_dir=tmp_path / "cache")
    path = _save(tmp_path, "corpus", _columns(_records(source), id_key), fmt)
    corpus = Corpus.open(path)
    assert len(corpus) == len(reference)
    assert corpus.passages(range(len(corpus))) == reference.passages(range(len(reference)))
    ids = [reference.id(r) for r in range(len(reference))]
    assert corpus.rows(ids[::-1]).tolist() == list(range(len(ids)))[::-1]
    assert corpus.byte_lengths().tolist() == [len((p["title"] + p["text"]).encode()) for p in corpus.passages(
        range(len(corpus)))]
    files = [path] if fmt == "parquet" else sorted(path.glob("data-*.arrow"))
    assert corpus.fingerprint == hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    assert pickle.loads(pickle.dumps(corpus)).passage(len(corpus) - 1) == reference.passage(len(reference) - 1)


def test_integer_ids_and_alternative_column_names(tmp_path):
    path = _save(tmp_path, "c", {"docid": [7, 3, 12], "contents": ["seven", "three", "twelve"]}, "parquet")
    corpus = Corpus.open(path)
    assert [corpus.id(r) for r in range(3)] == ["7", "3", "12"] and corpus.row(12) == 2
    assert corpus.passage(1) == {"id": "3", "title": "", "text": "three"}


def test_memory_mapped_not_loaded(tmp_path):
    """Opening a 60 MB datasets folder and reading from it allocates next to nothing in Arrow's memory pool
    (a loaded table would allocate its whole size there)."""
    rows = 60_000
    text = ["x" * 1000 + str(i) for i in range(rows)]
    path = _save(tmp_path, "big", {"id": [str(i) for i in range(rows)], "text": text}, "datasets")
    Corpus.open(path, cache_dir=tmp_path / "cache")  # builds the index (a scan; its batches are freed)
    before = pa.total_allocated_bytes()
    corpus = Corpus.open(path, cache_dir=tmp_path / "cache")
    assert corpus.text(rows - 1) == text[-1] and corpus.passage(123)["text"] == text[123]
    assert pa.total_allocated_bytes() - before < 1_000_000


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_index_reused_and_rebuilt_when_the_source_changes(tmp_path, monkeypatch, fmt):
    path = _save(tmp_path, "c", {"id": ["a", "b"], "text": ["one", "two"]}, fmt)
    first = Corpus.open(path)
    builds = []
    real_build = corpus_module._build_index
    monkeypatch.setattr(corpus_module, "_build_index", lambda *a: (builds.append(a), real_build(*a)))
    assert Corpus.open(path).fingerprint == first.fingerprint and builds == []
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path = _save(tmp_path, "c", {"id": ["a", "b", "c"], "text": ["uno", "two", "three"]}, fmt)
    changed = Corpus.open(path)
    assert len(builds) == 1 and changed.passage(0)["text"] == "uno" and changed.row("c") == 2
    assert changed.fingerprint != first.fingerprint


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
@pytest.mark.parametrize("columns, where, field, message", [
    ({"name": ["a"], "text": ["t"]}, "", "id", r"no id column \(one of .*columns are \['name', 'text'\]"),
    ({"id": ["a"], "body": ["t"]}, "", "text", r"no text column"),
    ({"id": [1.5], "text": ["t"]}, "", "id", r"column type double; expected string or integer ids"),
    ({"id": [True], "text": ["t"]}, "", "id", r"column type bool"),
    ({"id": ["a"], "text": [3]}, "", "text", r"column type int64; expected string"),
    ({"id": ["a"], "text": ["t"], "title": [[1]]}, "", "title", r"column type list<item: int64>"),
    ({"id": ["a", None], "text": ["t", "u"]}, ": row 1", "id", r"null"),
    ({"id": ["a", "b", "c"], "text": ["t", "u", None]}, ": row 2", "text", r"null"),
    ({"id": ["a", " "], "text": ["t", "u"]}, ": row 1", "id", r"empty passage id"),
    ({"id": ["a", "b\nc"], "text": ["t", "u"]}, ": row 1", "id", r"passage id contains a newline or NUL byte"),
    ({"id": ["a", "b", "a", "b"], "text": ["t"] * 4}, ": row 2", "id",
     r"duplicate passage id 'a' \(first seen on row 0\); 2 duplicate\(s\) in all"),
])
def test_malformed_tables_name_file_row_field(tmp_path, fmt, columns, where, field, message):
    path = _save(tmp_path, "bad", columns, fmt)
    what = f" field '{field}':" if field else ""
    with pytest.raises(DataError, match=f"^{path}{where}:{what} {message}"):
        Corpus.open(path)
    assert not path.with_name(path.name + ".index").exists()  # nothing a later run could trust


def test_not_a_dataset_folder_a_datasetdict_and_a_broken_parquet(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match=r"plain: a folder must be a datasets.save_to_disk folder"):
        Corpus.open(tmp_path / "plain")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"id": ["a"], "text": ["t"]})})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict with splits \['train'\]; give one split's folder"):
        Corpus.open(tmp_path / "dd")
    assert Corpus.open(tmp_path / "dd" / "train").passage(0) == {"id": "a", "title": "", "text": "t"}
    empty = pa.table({"id": [], "text": []}, schema=pa.schema([("id", pa.string()), ("text", pa.string())]))
    pq.write_table(empty, tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty.parquet: no passages"):
        Corpus.open(tmp_path / "empty.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"broken.parquet: not a readable parquet file"):
        Corpus.open(tmp_path / "broken.parquet")


def damage_saved_dataset(folder: Path, damage: str) -> tuple[Path, str]:
    """Damage a datasets.save_to_disk folder as a copy cut short or half-deleted would; (file named, message)."""
    arrow = next(folder.glob("*.arrow"))
    state = folder / "state.json"
    if damage == "truncated-arrow":
        arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
        return arrow, "cannot be read .*a truncated or damaged datasets.save_to_disk folder"
    if damage == "missing-arrow":
        arrow.unlink()
        return arrow, f"missing \\(listed in {state}\\)"
    if damage == "missing-state":
        state.unlink()
        return state, f"missing, though {folder} holds {arrow.name}.*a damaged datasets.save_to_disk folder"
    state.write_bytes(state.read_bytes()[:10])  # truncated-state
    return state, "field '_data_files': not readable"


DAMAGES = ["truncated-arrow", "missing-arrow", "missing-state", "truncated-state"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_saved_dataset_is_named_as_corpus_and_as_qa_set(tmp_path, damage):
    """A datasets.save_to_disk folder cut short (truncated Arrow file, state.json or an Arrow file missing,
    state.json truncated), as passages or as a QA / retrieval dev set: a DataError naming the file at fault (was an
    OSError / json error from inside datasets or pyarrow), and no corpus index left behind."""
    from rag_train.eval.retrieval import load_eval_set

    reference = Corpus.open(FIXTURES / "passages.jsonl", cache_dir=tmp_path / "cache")
    corpus = _save(tmp_path, "corpus", _columns(_records(FIXTURES / "passages.jsonl"), "id"), "datasets")
    qa = _save(tmp_path, "qa", {"question": ["q1", "q2"], "answers": [["a"], ["b"]]}, "datasets")
    for folder in (corpus, qa):
        where, message = damage_saved_dataset(folder, damage)
        calls = [lambda: Corpus.open(folder)] if folder == corpus else [lambda: load_qa(folder),
                                                                        lambda: load_eval_set(folder, reference)]
        for call in calls:
            with pytest.raises(DataError, match=f"^{where}: {message}"):
                call()
    assert not corpus.with_name(corpus.name + ".index").exists()


def test_a_damaged_saved_dataset_through_a_recipe_exits_2(tmp_path, recipe_toy_dir, capsys):
    """The same as `data.passages` of a run and through the entry scripts' fault handling: exit status 2 and one
    line naming the file, nothing written into the run directory."""
    from rag_train.cli import exit_on_fault
    from rag_train.train.retriever import train_retriever

    from test_faults import config, data_overrides

    corpus = _save(tmp_path, "corpus", _columns(_records(recipe_toy_dir / "passages.jsonl"), "id"), "datasets")
    where, _ = damage_saved_dataset(corpus, "truncated-arrow")
    out = tmp_path / "run"
    cfg = config(recipe_toy_dir, out,
                 **data_overrides(recipe_toy_dir, corpus, recipe_toy_dir / "retrieval-train.jsonl"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        with exit_on_fault():
            train_retriever(cfg)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {where}: cannot be read"), err


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_qa_sets_from_tables_equal_jsonl(tmp_path, fmt):
    source = FIXTURES / "qa" / "qa.jsonl"
    records = _records(source)
    columns = {"id": [None if r.get("id") is None else str(r["id"]) for r in records],  # one type per column
               "question": [r["question"] for r in records], "answers": [r["answers"] for r in records],
               "gold_ids": [None if "gold_ids" not in r else [str(g) for g in r["gold_ids"]] for r in records]}
    path = _save(tmp_path, "qa", columns, fmt)
    from_table, from_jsonl = load_qa(path), load_qa(source)
    # ids default to the record's position: line numbers for JSONL (a blank line 3), rows for tables
    assert [e.id for e in from_table] == ["q1", "q2", "qa-2", "4"]
    assert [e.id for e in from_jsonl] == ["q1", "q2", "qa-4", "4"]
    assert [(e.question, e.answers, e.gold_ids) for e in from_table] == [
        (e.question, e.answers, e.gold_ids) for e in from_jsonl]


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_qa_tables_name_file_row_field(tmp_path, fmt):
    path = _save(tmp_path, "qa", {"question": ["q1", None], "answers": [["a"], ["b"]]}, fmt)
    with pytest.raises(DataError, match=f"^{path}: row 1: field 'question': missing or empty"):
        load_qa(path)
    path = _save(tmp_path, "qb", {"question": ["q1", "q2"], "answers": [1, 2]}, fmt)
    with pytest.raises(DataError, match=f"^{path}: row 0: field 'answers': missing, or not a string"):
        load_qa(path)
    path = _save(tmp_path, "qc", {"id": ["x", "x"], "question": ["q1", "q2"], "answers": [["a"], ["b"]]}, fmt)
    with pytest.raises(DataError, match=f"^{path}: row 1: field 'id': duplicate question id 'x' \\(first on row 0\\)"):
        load_qa(path)


def test_duplicate_question_ids_in_jsonl(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text('{"id": "x", "question": "q", "answers": ["a"]}\n{"id": "x", "question": "r", "answers": ["b"]}\n')
    with pytest.raises(DataError, match=r"qa.jsonl:2: field 'id': duplicate question id 'x' \(first on line 1\)"):
        load_qa(path)


def test_beir_with_hub_parquet_corpus_and_queries(tmp_path):
    """The hub's BEIR layout: corpus.parquet / queries.parquet with the same qrels: the same examples."""
    beir = tmp_path / "beir"
    shutil.copytree(FIXTURES / "beir" / "qrels", beir / "qrels")
    queries = _records(FIXTURES / "beir" / "queries.jsonl")
    pq.write_table(pa.table({"_id": [q["_id"] for q in queries], "text": [q["text"] for q in queries]}),
                   beir / "queries.parquet")
    corpus_path = _save(beir, "corpus", _columns(_records(FIXTURES / "beir" / "corpus.jsonl"), "_id"), "parquet")
    corpus = Corpus.open(corpus_path)
    assert load_retrieval(beir, corpus=corpus) == load_retrieval(FIXTURES / "beir")
    assert load_retrieval(beir / "qrels" / "test.tsv") == load_retrieval(FIXTURES / "beir")  # a split by its file
    pq.write_table(pa.table({"_id": ["q1", "q1"], "text": ["a", "b"]}), beir / "queries.parquet")
    with pytest.raises(DataError, match=r"queries.parquet: row 1: field '_id': duplicate query id 'q1'"):
        load_retrieval(beir)


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_padded_ids_are_stripped_and_blank_passages_warned_about(tmp_path, fmt):
    from rag_train.data.corpus import BlankPassagesWarning

    path = _save(tmp_path, "c", {"id": ["a", " b ", "c"], "text": ["x", " ", "z"]}, fmt)
    with pytest.warns(BlankPassagesWarning, match=r"1 passage\(s\) with blank text \(the first: id 'b'\)"):
        corpus = Corpus.open(path)
    assert corpus.id(1) == "b" and corpus.row("b") == 1
    dup = _save(tmp_path, "d", {"id": ["a", "b", "a "], "text": ["x", "y", "z"]}, fmt)
    with pytest.raises(DataError, match=r"row 2: field 'id': duplicate passage id 'a' \(first seen on row 0\)"):
        Corpus.open(dup)

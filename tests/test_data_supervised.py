"""Supervised retrieval loaders: DPR JSON / JSONL, MS MARCO queries + qrels (TREC 4-col, 2-col),
BEIR directories; dispatch on the source; ids checked against the corpus with file / line / field."""

import json
import logging
import shutil
from pathlib import Path

import pytest

from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError
from rag_train.data.supervised import RetrievalExample, load_retrieval

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    cache = tmp_path_factory.mktemp("index")
    return {name: Corpus.open(FIXTURES / name, cache_dir=cache)
            for name in ("psgs_w100.tsv", "msmarco/collection.tsv", "beir/corpus.jsonl")}


def test_dpr_json_and_jsonl(corpora, caplog):
    with caplog.at_level(logging.WARNING):
        examples = load_retrieval(FIXTURES / "dpr/nq-train.json", corpus=corpora["psgs_w100.tsv"])
    assert examples == [
        RetrievalExample("who was the brother of moses", ["1"], ["2", "5"], ["Aaron"], "nq-train-1"),
        RetrievalExample("when was the eiffel tower completed", ["4", "3"], [], ["1889"], "nq-train-3"),
    ]
    assert "skipped 1 of 3 examples without positive_ctxs" in caplog.text
    jsonl = load_retrieval(FIXTURES / "dpr/retrieval.jsonl", corpus=corpora["psgs_w100.tsv"])
    assert jsonl == [RetrievalExample("who led the israelites", ["2"], ["1"], ["Moses"], "r1"),
                     RetrievalExample("how high is everest", ["5"], [], [], "retrieval-2")]
    assert load_retrieval(FIXTURES / "dpr/nq-train.json", limit=1) == examples[:1]


def test_msmarco_dir_and_queries_file(corpora):
    corpus = corpora["msmarco/collection.tsv"]
    dev = load_retrieval(FIXTURES / "msmarco", corpus=corpus, split="dev")  # TREC 4-column qrels, one rel=0
    assert dev == [RetrievalExample("what is paula deen's brother", ["0"], [], [], "1048585"),
                   RetrievalExample("what was the manhattan project", ["1", "3"], [], [], "2"),
                   RetrievalExample("what is the capital of france", ["4"], [], [], "3")]
    train = load_retrieval(FIXTURES / "msmarco/queries.train.tsv", corpus=corpus)  # 2-column qrels
    assert [(e.id, e.positive_ids) for e in train] == [("10", ["5"]), ("11", ["4"])]
    with pytest.raises(DataError, match=r"name a split \(one of \['dev', 'train'\]\)"):
        load_retrieval(FIXTURES / "msmarco")
    with pytest.raises(DataError, match=r"no queries.eval.tsv \(splits here: \['dev', 'train'\]\)"):
        load_retrieval(FIXTURES / "msmarco", split="eval")


def test_trec_space_separated_qrels_and_query_without_judgement(tmp_path):
    (tmp_path / "queries.small.tsv").write_text("7\tfirst\n8\tunjudged\n9\tthird\n")
    (tmp_path / "qrels.small.tsv").write_text("7 0 a 1\n9 0 b 2\n9 0 c 0\n99 0 z 1\n")
    examples = load_retrieval(tmp_path)
    assert examples == [RetrievalExample("first", ["a"], [], [], "7"),
                        RetrievalExample("third", ["b"], [], [], "9", grades=[2])]
    assert [e.qrels() for e in examples] == [{"a": 1}, {"b": 2}]  # graded judgements reach nDCG


def test_beir_dir(corpora, tmp_path):
    examples = load_retrieval(FIXTURES / "beir", corpus=corpora["beir/corpus.jsonl"])
    assert examples == [RetrievalExample("what was the manhattan project", ["doc0"], [], [], "q1"),
                        RetrievalExample("capital of france", ["doc1", "doc3"], [], [], "q2", grades=[2, 1])]
    with pytest.raises(DataError, match=r"BEIR split 'dev' has no qrels/dev.tsv \(splits here: \['test'\]\)"):
        load_retrieval(FIXTURES / "beir", split="dev")


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def _dpr(question="q", positives=({"passage_id": "1"},), **extra):
    return {"question": question, "answers": ["a"], "positive_ctxs": list(positives), **extra}


BAD_DPR_JSONL = [
    # (records or raw line, line, field)
    ([_dpr(), "{not json"], 2, None),
    ([_dpr(), {"answers": ["a"], "positive_ctxs": [{"passage_id": "1"}]}], 2, "question"),
    ([_dpr(positives=[{"title": "t", "text": "no id"}])], 1, "positive_ctxs[0]"),
    ([_dpr(hard_negative_ctxs="2")], 1, "hard_negative_ctxs"),
    ([_dpr(), {"question": "q", "answers": "a", "positive_ctxs": []}], 2, "answers"),
    ([{"question": "q", "answers": ["a"]}], 1, "positive_ctxs"),
]


@pytest.mark.parametrize("records, line, field", BAD_DPR_JSONL)
def test_malformed_dpr_jsonl(tmp_path, records, line, field):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path = _write(tmp_path / "bad_dpr.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        load_retrieval(path)
    assert f"bad_dpr.jsonl:{line}:" in str(info.value)
    if field is not None:
        assert f"field '{field}'" in str(info.value)


def test_dpr_json_list_errors_name_lines(tmp_path, corpora):
    items = [_dpr("first"), _dpr("second", hard_negative_ctxs=[{"passage_id": "2"}, {"passage_id": "404"}])]
    path = _write(tmp_path / "list.json", "[\n" + ",\n".join(json.dumps(i) for i in items) + "\n]\n")
    assert len(load_retrieval(path)) == 2
    with pytest.raises(DataError, match=r"list\.json:3: field 'hard_negative_ctxs\[1\]\.passage_id': "
                                        r"passage id '404' is not in the corpus"):
        load_retrieval(path, corpus=corpora["psgs_w100.tsv"])
    broken = _write(tmp_path / "broken.json", '[\n  {"question": "q",\n   "answers": [}\n]\n')
    with pytest.raises(DataError, match=r"broken\.json:3: bad JSON"):
        load_retrieval(broken)
    not_list = _write(tmp_path / "obj.json", '\n{"question": "q"}\n')
    with pytest.raises(DataError, match=r"obj\.json:2: expected a JSON list"):
        load_retrieval(not_list)
    no_comma = _write(tmp_path / "nocomma.json", json.dumps([_dpr()])[:-1] + "\n" + json.dumps(_dpr()) + "]")
    with pytest.raises(DataError, match=r"nocomma\.json:2: expected ',' or ']'"):
        load_retrieval(no_comma)
    empty = _write(tmp_path / "none.json", json.dumps([_dpr(positives=[])]))
    with pytest.raises(DataError, match=r"none\.json: field 'positive_ctxs': no examples with positive"):
        load_retrieval(empty)


def test_unknown_ids_in_dpr_jsonl_and_qrels(tmp_path, corpora):
    path = _write(tmp_path / "r.jsonl", json.dumps(_dpr()) + "\n" + json.dumps(_dpr(positives=[{"id": 77}])) + "\n")
    with pytest.raises(DataError, match=r"r\.jsonl:2: field 'positive_ctxs\[0\]\.id': passage id '77'"):
        load_retrieval(path, corpus=corpora["psgs_w100.tsv"])
    marco = tmp_path / "marco"
    shutil.copytree(FIXTURES / "msmarco", marco)
    _write(marco / "qrels.dev.tsv", "2\t0\t1\t1\n3\t0\t9999\t1\n")
    with pytest.raises(DataError, match=r"qrels\.dev\.tsv:2: field 'pid': passage id '9999'"):
        load_retrieval(marco, split="dev", corpus=corpora["msmarco/collection.tsv"])


BAD_TSV = [
    # (queries, qrels, file, line, field)
    ("1\tq\n2\n", "1 0 a 1\n", "queries.x.tsv", 2, "text"),
    ("1\tq\n1\tagain\n", "1 0 a 1\n", "queries.x.tsv", 2, "qid"),
    ("1\tq\n\t q\n", "1 0 a 1\n", "queries.x.tsv", 2, "qid"),
    ("1\tq\n", "1 0 a 1\n1 0 b yes\n", "qrels.x.tsv", 2, "relevance"),
    ("1\tq\n", "1 0 a 1\n1 b\n", "qrels.x.tsv", 2, None),
    ("1\tq\n", "1 0 a 1 extra\n", "qrels.x.tsv", 1, None),
]


@pytest.mark.parametrize("queries, qrels, name, line, field", BAD_TSV)
def test_malformed_msmarco(tmp_path, queries, qrels, name, line, field):
    _write(tmp_path / "queries.x.tsv", queries)
    _write(tmp_path / "qrels.x.tsv", qrels)
    with pytest.raises(DataError) as info:
        load_retrieval(tmp_path / "queries.x.tsv")
    assert f"{name}:{line}:" in str(info.value)
    if field is not None:
        assert f"field '{field}'" in str(info.value)


def test_malformed_beir_queries(tmp_path):
    beir = tmp_path / "beir"
    shutil.copytree(FIXTURES / "beir", beir)
    _write(beir / "queries.jsonl", '{"_id": "q1", "text": "ok"}\n{"_id": "q2"}\n')
    with pytest.raises(DataError, match=r"queries\.jsonl:2: field 'text'"):
        load_retrieval(beir)


def test_dispatch_explains_what_it_expected(tmp_path):
    for source in (tmp_path, _write(tmp_path / "train.csv", "q,a\n"), "ms_marco"):
        with pytest.raises(DataError, match=r"(expected|provide) a DPR JSON list .*MS MARCO .*BEIR"):
            load_retrieval(source)
    orphan = _write(tmp_path / "queries.dev.tsv", "1\tq\n")
    with pytest.raises(DataError,
                       match=r"queries\.dev\.tsv: MS MARCO queries need their judgements in qrels\.dev\.tsv"):
        load_retrieval(orphan)
    _write(tmp_path / "qrels.dev.tsv", "1\t0\tp\t0\n")
    with pytest.raises(DataError, match=r"qrels\.dev\.tsv: no query has a positive judgement"):
        load_retrieval(orphan)
    with pytest.raises(DataError, match="limit must be > 0"):
        load_retrieval(orphan, limit=0)

"""QA loaders: every released field layout normalises to QAExample, malformed input is named by
file / line / field, gold ids are checked against the corpus, and the hub path fails fast offline."""

import http.server
import json
import socket
import threading
import time
from pathlib import Path

import datasets
import pytest

from rag_train.data import qa as qa_module
from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError
from rag_train.data.qa import QAExample, load_qa

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return Corpus.open(FIXTURES / "passages.jsonl", cache_dir=tmp_path_factory.mktemp("index"))


def test_fixtures_normalise(corpus):
    nq = load_qa(FIXTURES / "qa/nq_open.jsonl")
    assert nq[1] == QAExample("when was the eiffel tower completed", ["1889", "in 1889"], "nq_open-2", [])
    tqa = load_qa(FIXTURES / "qa/trivia_qa.jsonl")
    assert tqa[0] == QAExample("Which city is the capital of France?", ["Paris", "Paree", "Paris, France"], "tc_1", [])
    hotpot = load_qa(FIXTURES / "qa/hotpot_qa.jsonl")
    assert [(e.id, e.answers) for e in hotpot] == [("5a8b57f25542995d1e6f1371", ["Paris"]),
                                                   ("5a8c7595554299585d9e36b6", ["yes"])]
    plain = load_qa(FIXTURES / "qa/qa.jsonl", corpus=corpus)
    assert plain == [
        QAExample("who led the israelites out of egypt", ["Moses"], "q1", ["p2"]),
        QAExample("in which city is the eiffel tower", ["Paris", "Paris, France"], "q2", ["p4", "p3"]),
        QAExample("what id does a question without one get", ["a default one"], "qa-4", []),
        QAExample("how high is everest", ["8,849 metres"], "4", ["p5", "8"]),
    ]
    assert corpus.rows(plain[1].gold_ids).tolist() == [3, 2]
    assert load_qa(FIXTURES / "qa/qa.jsonl", limit=2) == plain[:2]


BAD = [
    # (content, line, field)
    ('{"question": "q", "answers": ["a"]}\n{"question": "q2", "answers": ["a"\n', 2, None),
    ('{"answers": ["a"]}\n', 1, "question"),
    ('{"question": "q", "answers": ["a"]}\n{"question": "  ", "answers": ["a"]}\n', 2, "question"),
    ('{"question": "q", "answers": []}\n', 1, "answers"),
    ('{"question": "q", "answers": ["", " "]}\n', 1, "answers"),
    ('{"question": "q"}\n', 1, "answer"),
    ('{"question": "q", "answers": [1, 2]}\n', 1, "answers"),
    ('{"question": "q", "answer": {"aliases": []}}\n', 1, "answer"),
    ('{"question": "q", "answers": ["a"], "gold_ids": "p1"}\n', 1, "gold_ids"),
    ('{"question": "q", "answers": ["a"]}\n\n["q", "a"]\n', 3, None),
]


@pytest.mark.parametrize("content, line, field", BAD)
def test_malformed_records(tmp_path, content, line, field):
    path = tmp_path / "bad_qa.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as info:
        load_qa(path)
    assert f"bad_qa.jsonl:{line}:" in str(info.value)
    if field is not None:
        assert f"field '{field}'" in str(info.value)


def test_unknown_gold_id_names_id_and_line(tmp_path, corpus):
    path = tmp_path / "gold.jsonl"
    path.write_text('{"question": "q", "answers": ["a"], "gold_ids": ["p1"]}\n'
                    '{"question": "q", "answers": ["a"], "gold_ids": ["p2", "p404", "p405"]}\n')
    assert len(load_qa(path)) == 2  # without a corpus nothing is checked
    with pytest.raises(DataError, match=r"gold\.jsonl:2: field 'gold_ids': passage id 'p404' is not in the corpus"
                                        r".*\(2 unknown ids in all\)"):
        load_qa(path, corpus=corpus)


def test_bad_bytes_empty_and_unknown_source(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"question": "caf\xe9", "answers": ["a"]}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl:1: not valid UTF-8"):
        load_qa(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no QA examples"):
        load_qa(empty)
    with pytest.raises(DataError, match=r"not a file and not one of the hub names.*\"answers\""):
        load_qa(tmp_path / "missing.jsonl")


def test_hub_offline_flag_fails_immediately(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"nq_open: .*HF_HUB_OFFLINE is set.*local JSONL.*\"answers\""):
        load_qa("nq_open", split="validation")


@pytest.fixture
def online_env(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    from huggingface_hub import constants

    return lambda endpoint: monkeypatch.setattr(constants, "ENDPOINT", endpoint)


def _expect_fast_unreachable(name):
    started = time.monotonic()
    with pytest.raises(DataError, match=rf"{name}: the Hugging Face hub is unreachable.*local JSONL"):
        load_qa(name)
    # A guard against hanging on the network, not a speed test: the probe gives up after 3 s.
    assert time.monotonic() - started < 30


def test_hub_unreachable_fails_fast(online_env):
    """This machine has no network: the real endpoint must fail fast (skipped where it answers)."""
    if qa_module._offline_reason("google-research-datasets/nq_open") is None:
        pytest.skip("the hub is reachable from here")
    _expect_fast_unreachable("nq_open")


def test_hub_that_accepts_but_never_answers_fails_fast(online_env):
    with socket.create_server(("127.0.0.1", 0)) as silent:
        online_env(f"http://127.0.0.1:{silent.getsockname()[1]}")
        _expect_fast_unreachable("trivia_qa")


class _HubStub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200 if self.path == "/api/datasets/hotpotqa/hotpot_qa" else 503
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_probe_reads_http_status(online_env):
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubStub) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        online_env(f"http://127.0.0.1:{server.server_address[1]}")
        assert qa_module._offline_reason("hotpotqa/hotpot_qa") is None
        assert "HTTP 503" in qa_module._offline_reason("mandarjoshi/trivia_qa")
        server.shutdown()


def test_hub_rows_are_normalised(monkeypatch):
    calls = []
    rows = [{"question": "Which city?", "question_id": "tc_9",
             "answer": {"value": "Paris", "aliases": ["Paris", "Paree"]}},
            {"question": "Which river?", "question_id": "tc_10", "answer": {"value": "Seine", "aliases": []}}]

    def fake_load_dataset(repo, config, split):
        calls.append((repo, config, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(qa_module, "_offline_reason", lambda repo: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    examples = load_qa("trivia_qa", split="validation", limit=1)
    assert calls == [("mandarjoshi/trivia_qa", "unfiltered.nocontext", "validation")]
    assert examples == [QAExample("Which city?", ["Paris", "Paree"], "tc_9", [])]

    def failing_load_dataset(repo, config, split):
        raise ValueError("Unknown split 'dev'")

    monkeypatch.setattr(datasets, "load_dataset", failing_load_dataset)
    with pytest.raises(DataError, match=r"hotpot_qa: datasets.load_dataset\('hotpotqa/hotpot_qa', 'fullwiki', "
                                        r"split='dev'\) failed \(ValueError: Unknown split 'dev'\); provide a local"):
        load_qa("hotpot_qa", split="dev")


def _degenerate_file(tmp_path: Path) -> Path:
    path = tmp_path / "qa.jsonl"
    records = [{"question": "q1", "answers": ["The Beatles", "The"]},  # one good, one empty once normalised
               {"question": "q2", "answers": ["a"]},  # only an empty one: the question cannot be scored
               {"question": "q3", "answers": ["Paris"]},
               {"question": "q4", "answers": ["\u2014", "..."]}]  # punctuation only
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_answers_that_normalise_to_nothing_are_reported_by_policy(tmp_path, caplog):
    """Answers SQuAD's normalisation empties ("The", "a") or leaves as punctuation ("—", "..."), against
    which an empty prediction would score EM 1, are never taken silently: data.empty_answers=warn (the default)
    keeps them and logs the count and the first ones with their lines, drop removes them (and q2, left with no
    answer), error refuses the file naming the same."""
    from rag_train.eval.metrics import exact_match

    path = _degenerate_file(tmp_path)
    assert exact_match("", ["The"]) == 1.0  # why: the empty prediction "matches"
    with caplog.at_level("WARNING", logger="rag_train.data.qa"):
        kept = load_qa(path)
    assert [ex.answers for ex in kept] == [["The Beatles", "The"], ["a"], ["Paris"], ["\u2014", "..."]]
    said = caplog.text
    assert (f"{path}: 4 answer(s) of 3 question(s) normalise to nothing" in said
            and f"{path}:1: 'The', {path}:2: 'a', {path}:4: '\u2014', {path}:4: '...'" in said
            and "data.empty_answers=drop" in said), said
    caplog.clear()
    with caplog.at_level("WARNING", logger="rag_train.data.qa"):
        dropped = load_qa(path, empty_answers="drop")
    assert [(ex.question, ex.answers) for ex in dropped] == [("q1", ["The Beatles"]), ("q3", ["Paris"])]
    assert "Removed (data.empty_answers=drop), and with them 2 question(s) that had no other answer" in caplog.text
    with pytest.raises(DataError, match=f"^{path}: 4 answer\\(s\\) of 3 question\\(s\\) normalise to nothing .*"
                                        "e.g. .*qa.jsonl:1: 'The'.*set data.empty_answers=drop"):
        load_qa(path, empty_answers="error")


def test_the_empty_answer_policy_is_a_config_key(tmp_path, recipe_toy_dir):
    """data.empty_answers is validated with the config and reaches the recipe's loaders: an RLM run on such a
    training file with data.empty_answers=error stops before any work, naming the file."""
    from rag_train.config import ConfigError, DataConfig, load_config
    from rag_train.train.rlm import train_rlm
    from rag_train.train.schema import RLMConfig

    with pytest.raises(ConfigError, match=r"data.empty_answers='sometimes' is not one of \['warn', 'drop', 'error'\]"):
        DataConfig(empty_answers="sometimes")
    train = _degenerate_file(tmp_path)
    out = tmp_path / "run"
    cfg = load_config(RLMConfig, Path(__file__).parents[1] / "configs" / "toy" / "rlm.yaml",
                      [f"data.toy_dir={recipe_toy_dir}", "data.toy_passages=300", f"data.train={train}",
                       "data.empty_answers=error", f"train.output_dir={out}", "train.tracker=null"])
    with pytest.raises(DataError, match=f"^{train}: 4 answer"):
        train_rlm(cfg)
    assert not out.exists()  # nothing written is left: the corrected rerun is not refused

"""The `described` family (the non-saturating retrieval world): questions name their person by first name and one
other fact of the gold passage, never in full; the ceiling counts the people a description fits, checked against a
brute-force count over the rendered passages."""

import collections
import json
import re

import numpy as np
import pytest

from rag_train.config import ConfigError, DataConfig
from rag_train.data import toy_described
from rag_train.data.toy import FACTS, ToyWorld
from rag_train.data.toy_files import ensure_toy_world

from conftest import read_jsonl

PASSAGES, SEED = 1200, 5  # the `described_world` fixture's (conftest.py)
MENTOR_SENTENCE = re.compile(r"(?:was trained by|learned everything from) ([A-Z][a-z]+ [A-Z][a-z]+)\.|"
                             r"The mentor of [A-Z][a-z]+(?: [A-Z][a-z]+)? is ([A-Z][a-z]+ [A-Z][a-z]+)\.")
PHRASES = {value.split(" {v}")[0]: clue for clue, values in toy_described.PHRASES.items() for value in values}
DESCRIBED = re.compile(r"the ([A-Z][a-z]+) who (" + "|".join(map(re.escape, PHRASES)) + r") (.+?)(?: born| play)?\?$")


def states(passage, clue, value):
    """Does the passage state `value` as its own person's fact `clue` (read from the text, not from the generator)?"""
    if FACTS[clue].pool == "person":
        found = MENTOR_SENTENCE.search(passage["text"])
        return bool(found) and value in found.groups()
    return re.search(rf"\b{re.escape(value)}\b", passage["text"]) is not None and FACTS[clue].section == \
        int(passage["id"][1:]) % 2


def test_described_questions_name_no_one_in_full_and_their_gold_states_clue_and_answer(described_world):
    passages = {p["id"]: p for p in read_jsonl(described_world["passages"])}
    ToyWorldSplit = {"train": False, "dev": True}
    clues = collections.Counter()
    for split, dev in ToyWorldSplit.items():
        questions = read_jsonl(described_world[f"described-{split}"])
        assert len(questions) == min(PASSAGES if split == "train" else 120, toy_described.capacity(
            ToyWorld(PASSAGES, SEED), split))
        assert len({(q["question"], q["gold_ids"][0]) for q in questions}) == len(questions)
        for q in questions:
            (gold,) = [passages[g] for g in q["gold_ids"]]
            first, phrase, value = DESCRIBED.search(q["question"]).groups()
            clues[PHRASES[phrase]] += 1
            assert gold["title"] not in q["question"]  # the person is never named in full: nothing to copy
            assert gold["title"].split()[0] == first and states(gold, PHRASES[phrase], value)
            assert re.search(rf"\b{re.escape(q['answers'][0])}\b", gold["text"])
            assert phrase not in gold["text"]  # worded unlike the passage
            assert (int(gold["id"][1:]) // 2 % 10 == 0) == dev
    assert set(clues) == {0, 1, 2, 5}  # birthplace, birth year, employer, mentor


def test_fitting_and_ceiling_match_a_brute_force_count_over_the_passages(described_world):
    passages = read_jsonl(described_world["passages"])
    questions = read_jsonl(described_world["described-dev"])
    counts = []
    for q in questions:
        first, phrase, value = DESCRIBED.search(q["question"]).groups()
        counts.append(sum(p["title"].split()[0] == first and states(p, PHRASES[phrase], value) for p in passages))
    fitting = toy_described.fitting(ToyWorld(PASSAGES, SEED), "dev", 0, len(questions))
    assert fitting.tolist() == counts and max(counts) > 1  # some descriptions fit several people
    expected = 100 * float(np.mean([1 / c for c in counts]))
    assert toy_described.ceiling(ToyWorld(PASSAGES, SEED), "dev", len(questions)) == pytest.approx(expected)
    assert json.loads(described_world["manifest"].read_text())["described_ceiling"]["dev"] == round(expected, 2)


def test_retrieval_files_of_a_described_world_ask_the_described_questions(described_world):
    for split in ("train", "dev"):
        retrieval = read_jsonl(described_world[f"retrieval-{split}"])
        described = read_jsonl(described_world[f"described-{split}"])
        assert [(r["question"], r["positive_ctxs"][0]["passage_id"]) for r in retrieval] == \
            [(d["question"], d["gold_ids"][0]) for d in described]


def test_a_named_world_is_not_replaced_by_a_described_one_silently(tmp_path):
    cfg = DataConfig(toy_dir=str(tmp_path / "toy"), toy_passages=400, toy_seed=1)
    paths = ensure_toy_world(cfg, tokenizer_vocab=None)
    assert "described-dev" not in paths and "retrieval" not in json.loads(paths["manifest"].read_text())
    described = DataConfig(toy_dir=cfg.toy_dir, toy_passages=400, toy_seed=1, toy_retrieval="described")
    with pytest.raises(ConfigError, match=r"named retrieval questions\);.*data.toy_retrieval=described"):
        ensure_toy_world(described, tokenizer_vocab=None)
    with pytest.raises(ConfigError, match="data.toy_retrieval=.paraphrased. is not one of"):
        DataConfig(toy_retrieval="paraphrased")
    described.toy_regenerate = True
    paths = ensure_toy_world(described, tokenizer_vocab=None)
    assert read_jsonl(paths["retrieval-dev"])[0]["id"].startswith("described-dev-") and paths["described-dev"].is_file()

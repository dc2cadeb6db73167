"""Metrics against hand cases reproducing the SQuAD v1.1 script and DPR's has_answer behaviour.

(`evaluate.load("squad")` needs the hub, unreachable here, so the reference is the scripts' behaviour.)
"""

from __future__ import annotations

import math

import pytest

from rag_train.eval.metrics import (
    answer_recall_at_k,
    dpr_tokens,
    exact_match,
    has_answer,
    normalize_answer,
    ranking_metrics,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The  Cat!", "cat"),
        ("A man, a plan, a canal: Panama", "man plan canal panama"),
        ("an Apple", "apple"),
        ("Theatre anathema", "theatre anathema"),  # articles only as whole words
        ("the-end", "theend"),  # punctuation removed first, so no word boundary appears
        ("a.b", "ab"),
        ("  spaced\tout\n", "spaced out"),
        ("“curly”", "“curly”"),  # only ASCII punctuation, as in the script
        ("THE", ""),
    ],
)
def test_normalize_answer_squad_v11(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_is_max_over_answers():
    assert exact_match("The Paris", ["London", "paris."]) == 1.0
    assert exact_match("Pariss", ["paris"]) == 0.0
    assert exact_match("", ["the"]) == 1.0  # both normalise to the empty string
    assert exact_match("x", []) == 0.0


def test_dpr_tokens_split_punctuation_and_keep_marks():
    assert dpr_tokens("U.S. Army's 1st!") == ["u", ".", "s", ".", "army", "'", "s", "1st", "!"]
    assert dpr_tokens("Café") == ["cafe\u0301"]  # NFD: e + combining accent stay in one token


@pytest.mark.parametrize(
    "text, answers, expected",
    [
        ("The Eiffel Tower is in Paris.", ["paris"], True),
        ("Parisian food is good", ["Paris"], False),  # token match, not substring
        ("born in 1879 in Ulm", ["1879"], True),
        ("born in 1879 in Ulm", ["879"], False),
        ("new york city", ["New York"], True),
        ("new york city", ["York New"], False),
        ("the U.S. army", ["U.S."], True),
        ("Caf\u00e9 de Flore", ["Cafe\u0301"], True),  # composed vs decomposed: equal after NFD
        ("Caf\u00e9 de Flore", ["Cafe"], False),
        ("anything", ["", "zzz"], False),
        ("x", ["q", "X"], True),
    ],
)
def test_has_answer_dpr(text, answers, expected):
    assert has_answer(text, answers) is expected


def test_ranking_metrics_equal_hand_computation():
    """ir_measures' figures against the textbook definitions worked by hand (binary and graded qrels)."""
    run = {"q1": {"a": 3.0, "b": 2.0, "c": 1.0}, "q2": {"x": 3.0, "y": 2.0, "z": 1.0},
           "q3": {"m": 3.0, "n": 2.0, "o": 1.0}, "unjudged": {"a": 1.0}}
    qrels = {"q1": {"b": 1}, "q2": {"q": 1, "z": 1}, "q3": {"m": 2, "o": 1}, "none": {"a": 0}}
    got = ranking_metrics(run, qrels, [1, 2, 3])
    assert got["recall"] == pytest.approx({"1": (0 + 0 + 0.5) / 3, "2": (1 + 0 + 0.5) / 3, "3": (1 + 0.5 + 1) / 3})
    assert got["mrr@10"] == pytest.approx((1 / 2 + 1 / 3 + 1) / 3)
    assert got["map@3"] == pytest.approx((1 / 2 + (1 / 3) / 2 + (1 + 2 / 3) / 2) / 3)
    dcg = [1 / math.log2(3), 1 / math.log2(4), 2 / math.log2(2) + 1 / math.log2(4)]  # gain = grade (trec_eval)
    ideal = [1.0, 1 + 1 / math.log2(3), 2 / math.log2(2) + 1 / math.log2(3)]
    assert got["ndcg@10"] == pytest.approx(sum(d / i for d, i in zip(dcg, ideal)) / 3)
    with pytest.raises(ValueError, match="k=0"):
        ranking_metrics(run, qrels, [0])
    with pytest.raises(ValueError, match="'q4' has no ranking"):
        ranking_metrics(run, {**qrels, "q4": {"a": 1}}, [1])
    with pytest.raises(ValueError, match="no query has a relevant passage"):
        ranking_metrics(run, {"none": {"a": 0}}, [1])


def test_answer_recall_is_dpr_top_k_accuracy():
    texts = [["nothing here", "Paris is big", "paris again"], ["no", "none", "nope"]]
    answers = [["Paris"], ["yes"]]
    assert answer_recall_at_k(texts, answers, [1, 2, 5]) == {1: 0.0, 2: 0.5, 5: 0.5}


def test_answer_recall_reads_a_passage_only_when_its_scan_reaches_it():
    """Ranked keys (corpus rows) with a tokens function: the same figures as has_answer over every text, while a
    question's scan stops at its first answer-bearing passage and at the largest k."""
    import random

    rng = random.Random(0)
    words = ["Paris", "Rome", "Oslo", "Lima"] + [f"w{i}" for i in range(16)]  # an answer in about 1 text of 4
    texts = [" ".join(rng.choice(words) for _ in range(6)) for _ in range(40)]
    ranked = [rng.sample(range(40), 10) for _ in range(30)]
    answers = [rng.sample(words[:4], rng.choice([1, 2])) for _ in range(30)]  # one or two answer strings
    ks = [1, 3, 5]
    read = []

    def tokens(row):
        read.append(row)
        return dpr_tokens(texts[row])

    expected = {}
    for k in ks:  # brute force: every text of the top k through has_answer
        expected[k] = sum(any(has_answer(texts[r], golds) for r in rows[:k])
                          for rows, golds in zip(ranked, answers)) / len(ranked)
    assert answer_recall_at_k(ranked, answers, ks, tokens) == expected
    assert answer_recall_at_k([[texts[r] for r in rows] for rows in ranked], answers, ks) == expected
    stops = [next((i + 1 for i, r in enumerate(rows[:5]) if has_answer(texts[r], golds)), 5)
             for rows, golds in zip(ranked, answers)]
    assert len(read) == sum(stops) < 30 * 10
    assert 0 < expected[5] < 1 and any(len(golds) == 2 for golds in answers)  # scans that hit the cap, two answers

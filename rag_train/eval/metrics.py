"""QA and retrieval metrics with the field's exact definitions.

- `normalize_answer` / `exact_match`: the SQuAD v1.1 evaluation script (used by FiD, Atlas, seed 000).
- `has_answer`: DPR's answer-string match (its SimpleTokenizer, uncased, NFD-normalised): a passage
  "has" an answer when the answer's token sequence occurs in the passage's token sequence.
- `ranking_metrics`: recall@k, MRR@10, nDCG@10, MAP of a run against qrels, by ir_measures (the standard
  tools' numbers, not a re-implementation); `answer_recall_at_k` is DPR's top-k retrieval accuracy (the NQ
  "R@k" of seed 000's tables), which no IR library computes: it judges passages by answer strings.
"""

from __future__ import annotations

import unicodedata
from typing import Callable, Iterable, Sequence, TypeVar

import ir_measures
import regex
from ir_measures import AP, RR, R, nDCG

from rag_train.data.answers import normalize_answer  # SQuAD's, used by the loaders too
from rag_train.eval.trec import Qrels, Run

T = TypeVar("T")

# DPR SimpleTokenizer: runs of letters / numbers / marks, or any other single non-space character.
_DPR_TOKEN = regex.compile(r"([\p{L}\p{N}\p{M}]+)|([^\p{Z}\p{C}])",
                           flags=regex.IGNORECASE | regex.UNICODE | regex.MULTILINE)


def exact_match(prediction: str, answers: Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(answer) for answer in answers))


def dpr_tokens(text: str) -> list[str]:
    """DPR's uncased SimpleTokenizer words of NFD-normalised text."""
    return [match.group().lower() for match in _DPR_TOKEN.finditer(unicodedata.normalize("NFD", text))]


def has_answer(text: str, answers: Iterable[str]) -> bool:
    """True when some answer's DPR token sequence occurs contiguously in the text's (an answer with no
    tokens matches nothing, where DPR's loop would match it everywhere)."""
    return _contains(dpr_tokens(text), [dpr_tokens(answer) for answer in answers])


def _contains(tokens: list[str], needles: list[list[str]]) -> bool:
    for needle in needles:
        width = len(needle)
        if width and any(tokens[i : i + width] == needle for i in range(len(tokens) - width + 1)):
            return True
    return False


def _check_ks(ks: Sequence[int]) -> None:
    for k in ks:
        if k <= 0:
            raise ValueError(f"cut-off k={k} must be > 0")


def _check_lengths(ranked: Sequence, gold: Sequence) -> None:
    if len(ranked) != len(gold):
        raise ValueError(f"{len(ranked)} rankings but {len(gold)} gold sets")
    if not ranked:
        raise ValueError("no queries to evaluate")


def ranking_metrics(run: Run, qrels: Qrels, ks: Sequence[int]) -> dict:
    """recall@k (|relevant in top k| / |relevant|), MRR@10, nDCG@10 (graded gains, as BEIR) and MAP over the
    retrieved depth, computed by ir_measures (trec_eval's definitions via pytrec_eval) on the judged queries.
    Every judged query must have a ranking; relevance > 0 counts as relevant."""
    _check_ks(ks)
    judged = {qid: grades for qid, grades in qrels.items() if any(g > 0 for g in grades.values())}
    if not judged:
        raise ValueError("no query has a relevant passage to evaluate")
    unranked = [qid for qid in judged if not run.get(qid)]
    if unranked:
        raise ValueError(f"judged query {unranked[0]!r} has no ranking ({len(unranked)} in all)")
    ranked = {qid: run[qid] for qid in judged}
    depth = max(len(ranking) for ranking in ranked.values())
    measures = [R @ k for k in ks] + [RR @ 10, nDCG @ 10, AP @ depth]
    values = ir_measures.calc_aggregate(measures, judged, ranked)
    return {"recall": {str(k): values[R @ k] for k in ks}, "mrr@10": values[RR @ 10],
            "ndcg@10": values[nDCG @ 10], f"map@{depth}": values[AP @ depth]}


def answer_recall_at_k(
    ranked: Sequence[Sequence[T]], answers: Sequence[Iterable[str]], ks: Sequence[int],
    tokens: Callable[[T], list[str]] = dpr_tokens,
) -> dict[int, float]:
    """Fraction of questions with a passage containing an answer (`has_answer`) in the top k (DPR). `ranked`:
    per question its passages' texts, or any keys of them that `tokens` turns into DPR tokens (e.g. corpus rows,
    with a cache: a passage is read and tokenized only when the scan reaches it, and once per evaluation). The
    scan of a question stops at its first answer-bearing passage, and at the largest k."""
    _check_ks(ks)
    _check_lengths(ranked, answers)
    depth = max(ks)
    totals = {k: 0 for k in ks}
    for keys, golds in zip(ranked, answers):
        needles = [dpr_tokens(answer) for answer in golds]
        first = next((rank for rank, key in enumerate(keys[:depth], start=1) if _contains(tokens(key), needles)), None)
        for k in ks:
            totals[k] += first is not None and first <= k
    return {k: total / len(ranked) for k, total in totals.items()}

"""TREC run and qrels files, so rankings can be checked with the field's tools (ir_measures, pytrec_eval,
trec_eval, ranx):

    run:    qid Q0 docid rank score tag     (one line per retrieved passage, rank 1..k)
    qrels:  qid 0 docid relevance

    ir_measures <run>/eval/step-100/nq.qrels <run>/eval/step-100/nq.trec 'nDCG@10 RR@10 R@100 AP@100'

trec_eval (and so pytrec_eval and ir_measures) orders a query's passages by score, breaking ties by docid,
and ignores the rank column; scores are written with `repr`, which reads back as the same float, so a tool
reading the file sees exactly the run our metrics were computed on.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from rag_train.data.errors import DataError
from rag_train.io import atomic_write_text

Run = dict[str, dict[str, float]]  # qid -> docid -> score (ir_measures / pytrec_eval's in-memory run)
Qrels = dict[str, dict[str, int]]  # qid -> docid -> relevance grade (> 0: relevant)
RUN_TAG = "rag-train"
_WHITESPACE = re.compile(r"\s")


def check_trec_id(value: str, what: str) -> None:
    """TREC files are whitespace-separated: an id holding a space or tab cannot be written into one."""
    if not value or _WHITESPACE.search(value):
        raise DataError(f"{what} {value!r} is empty or contains whitespace; TREC run / qrels files cannot hold it")


def make_run(qids: Sequence[str], ranked_ids: Sequence[Sequence[str]], scores: Sequence[Sequence[float]]) -> Run:
    """{qid: {docid: score}} from parallel ranked lists (best first); qids must be unique."""
    run: Run = {}
    for qid, ids, values in zip(qids, ranked_ids, scores, strict=True):
        if qid in run:
            raise DataError(f"query id {qid!r} occurs twice; a run needs unique query ids")
        run[qid] = {docid: float(score) for docid, score in zip(ids, values, strict=True)}
    return run


def write_run(path: str | Path, run: Run, tag: str = RUN_TAG) -> None:
    """`qid Q0 docid rank score tag` lines, each query's passages in the order given (the rank column)."""
    check_trec_id(tag, "run tag")
    lines = []
    for qid, ranking in run.items():
        check_trec_id(qid, "query id")
        for rank, (docid, score) in enumerate(ranking.items(), start=1):
            check_trec_id(docid, "passage id")
            lines.append(f"{qid} Q0 {docid} {rank} {score!r} {tag}\n")
    atomic_write_text(path, "".join(lines))


def write_qrels(path: str | Path, qrels: Qrels) -> None:
    """`qid 0 docid relevance` lines."""
    lines = []
    for qid, judged in qrels.items():
        check_trec_id(qid, "query id")
        for docid, relevance in judged.items():
            check_trec_id(docid, "passage id")
            lines.append(f"{qid} 0 {docid} {int(relevance)}\n")
    atomic_write_text(path, "".join(lines))

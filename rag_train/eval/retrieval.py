"""Retrieval evaluation: over the corpus embedded by the current model (exact), or over a given shard of
passage vectors (the stale buffer: no corpus pass, used where the buffer IS the current model's embedding or
where a bound is enough during training; docs/scale.md).

Every evaluation can write its rankings as a TREC run file (and its judgements as qrels) so that the
numbers can be checked, and extended, with ir_measures / pytrec_eval / trec_eval."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from torch import nn

from rag_train.buffer.embed import embed_local_shard
from rag_train.buffer.search import SearchResult, search
from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError
from rag_train.data.qa import load_qa, read_jsonl
from rag_train.data.supervised import load_retrieval
from rag_train.eval.metrics import answer_recall_at_k, dpr_tokens, ranking_metrics
from rag_train.eval.trec import Run, make_run, write_qrels, write_run

logger = logging.getLogger(__name__)
MRR_DEPTH = 10  # MRR@10 and nDCG@10 need at least ten ranked passages


@dataclass
class EvalSet:
    """Questions with their ids, judgements (passage id -> relevance grade) and/or answer strings; either
    label may be empty per question."""

    questions: list[str]
    ids: list[str]
    qrels: list[dict[str, int]] = field(default_factory=list)
    answers: list[list[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.questions):
            raise ValueError(f"{len(self.questions)} questions but {len(self.ids)} ids")
        seen: set[str] = set()
        for qid in self.ids:
            if qid in seen:
                raise DataError(f"query id {qid!r} occurs twice; evaluation sets need unique query ids")
            seen.add(qid)


def load_eval_set(source: str | Path, corpus: Corpus, limit: Optional[int] = None,
                  empty_answers: str = "warn") -> EvalSet:
    """A retrieval evaluation set from any supported file: a supervised set (DPR with positive_ctxs, MS MARCO
    or BEIR judgements: recall / MRR / nDCG / MAP, and answer recall where answers are given) or a plain QA
    set (`{question, answers}` JSONL / parquet / datasets folder, e.g. NQ-open test: answer recall)."""
    path = Path(source)
    first = next(read_jsonl(path), (0, {}))[1] if path.suffix.lower() == ".jsonl" and path.is_file() else None
    plain_qa = first is not None and "positive_ctxs" not in first
    saved_dataset = path.is_dir() and ((path / "state.json").is_file() or any(path.glob("*.arrow")))
    if plain_qa or path.suffix.lower() == ".parquet" or saved_dataset:  # a damaged datasets folder is named there
        examples = load_qa(path, corpus=corpus, limit=limit, empty_answers=empty_answers)
        return EvalSet([e.question for e in examples], [e.id for e in examples],
                       [dict.fromkeys(e.gold_ids, 1) for e in examples], [e.answers for e in examples])
    examples = load_retrieval(path, corpus=corpus, limit=limit)
    return EvalSet([e.question for e in examples], [e.id for e in examples], [e.qrels() for e in examples],
                   [e.answers for e in examples])


@torch.inference_mode()
def rank_passages(model: nn.Module, vectors: torch.Tensor, row_offset: int, questions: list[str], k: int,
                  batch_size: int) -> SearchResult:
    """Rows and scores [len(questions), k], exact top-k of <f(x), g(y)>; sharded over processes when
    initialised (every process passes all questions and its own rows; the answer is the same on every one)."""
    was_training = model.training
    model.eval()
    rows, scores = [torch.zeros(0, k, dtype=torch.long)], [torch.zeros(0, k)]
    for start in range(0, len(questions), batch_size):
        queries = model.encode_queries(questions[start : start + batch_size]).float().to(vectors.device)
        found = search(queries, vectors, k, mode="exact", row_offset=row_offset)
        rows.append(found.rows.cpu())
        scores.append(found.scores.float().cpu())
    model.train(was_training)
    return SearchResult(scores=torch.cat(scores), rows=torch.cat(rows))


def ranking_run(corpus: Corpus, qids: list[str], ranked: SearchResult) -> Run:
    """The TREC run (qid -> passage id -> score) of a ranking over `corpus`."""
    ids = [[corpus.id(r) for r in row] for row in ranked.rows.tolist()]
    return make_run(qids, ids, ranked.scores.tolist())


def retrieval_metrics(corpus: Corpus, ranked: SearchResult, data: EvalSet, ks: list[int],
                      out_dir: Optional[Path] = None, name: str = "dev") -> dict:
    """recall@k, MRR@10, nDCG@10, MAP from the judgements (ir_measures) and DPR answer recall@k from the
    answer strings, for whichever labels exist. With `out_dir`: `<name>.trec` (and `<name>.qrels`) there.
    Each k is reported under its own key; a k above the ranking's depth (a corpus smaller than k) counts the
    whole ranking, which is what top-k of a smaller corpus is (the recipe warns about it before training)."""
    ks = sorted(set(ks))
    out: dict = {"questions": len(data.questions)}
    run = ranking_run(corpus, data.ids, ranked)
    qrels = {qid: grades for qid, grades in zip(data.ids, data.qrels) if grades}
    if qrels:
        out.update(ranking_metrics(run, qrels, ks))
    answered = [i for i, answers in enumerate(data.answers) if answers]
    if answered:
        rows = ranked.rows.tolist()
        # passages ranked high for many questions are read and tokenized once (bounded: ~100 MB of tokens)
        tokens = functools.lru_cache(maxsize=2**14)(lambda row: dpr_tokens(corpus.text(row)))
        out["answer_recall"] = {str(k): v for k, v in answer_recall_at_k(
            [rows[i] for i in answered], [data.answers[i] for i in answered], ks, tokens).items()}
    if out_dir is not None:
        try:
            write_run(Path(out_dir) / f"{name}.trec", run)
            if qrels:
                write_qrels(Path(out_dir) / f"{name}.qrels", qrels)
        except DataError as exc:  # TREC files cannot hold ids with spaces: keep the metrics, say why no file
            logger.warning("%s: no TREC run file written: %s", name, exc)
    return out


def evaluate_retrieval(model: nn.Module, corpus: Corpus, sets: dict[str, EvalSet], ks: list[int],
                       accelerator: Accelerator, batch_size: int, out_dir: Optional[Path] = None,
                       embed_workers: int = 0, shard: Optional[tuple[torch.Tensor, int]] = None) -> dict[str, dict]:
    """Rank every set and compute metrics, over the whole corpus embedded with `model` now (each process its
    share), or over `shard` = (this process's passage vectors, first row) when given (no corpus pass); the
    main process writes each set's run (and qrels) file into `out_dir` when given."""
    vectors, offset = shard or embed_local_shard(model, corpus, accelerator, batch_size, num_workers=embed_workers)
    k = min(max([*ks, MRR_DEPTH]), len(corpus))
    write_to = out_dir if accelerator.is_main_process else None
    return {name: retrieval_metrics(corpus, rank_passages(model, vectors, offset, data.questions, k, batch_size),
                                    data, ks, write_to, name)
            for name, data in sets.items()}

"""Retrieval evaluation, always over the corpus embedded by the current model (never a stale buffer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from torch import nn

from rag_train.buffer.embed import embed_local_shard
from rag_train.buffer.search import search
from rag_train.data.corpus import Corpus
from rag_train.eval.metrics import answer_recall_at_k, mrr_at_k, recall_at_k


@dataclass
class EvalSet:
    """Questions with gold passage ids and/or answer strings (either may be empty per question)."""

    questions: list[str]
    gold_ids: list[list[str]] = field(default_factory=list)
    answers: list[list[str]] = field(default_factory=list)


@torch.inference_mode()
def rank_passages(model: nn.Module, vectors: torch.Tensor, row_offset: int, questions: list[str], k: int,
                  batch_size: int) -> torch.Tensor:
    """[len(questions), k] corpus rows, exact top-k of <f(x), g(y)>; sharded over processes when initialised
    (every process passes all questions and its own rows; the answer is the same on every process)."""
    was_training = model.training
    model.eval()
    ranked = []
    for start in range(0, len(questions), batch_size):
        queries = model.encode_queries(questions[start : start + batch_size]).float().to(vectors.device)
        ranked.append(search(queries, vectors, k, mode="exact", row_offset=row_offset).rows.cpu())
    model.train(was_training)
    return torch.cat(ranked) if ranked else torch.zeros(0, k, dtype=torch.long)


def retrieval_metrics(corpus: Corpus, ranked: torch.Tensor, data: EvalSet, ks: list[int]) -> dict:
    """recall@k by gold id, DPR answer recall@k by answer string, MRR@10 — for whichever labels exist."""
    ks = sorted(k for k in ks if k <= ranked.shape[1]) or [ranked.shape[1]]
    out: dict = {"questions": len(data.questions)}
    ids = [[corpus.id(int(r)) for r in row] for row in ranked.tolist()]
    labelled = [i for i, gold in enumerate(data.gold_ids) if gold]
    if labelled:
        ranked_ids = [ids[i] for i in labelled]
        gold = [data.gold_ids[i] for i in labelled]
        out["recall"] = {str(k): v for k, v in recall_at_k(ranked_ids, gold, ks).items()}
        out["mrr@10"] = mrr_at_k(ranked_ids, gold, 10)
    answered = [i for i, answers in enumerate(data.answers) if answers]
    if answered:
        texts = [[corpus.text(int(r)) for r in ranked[i].tolist()] for i in answered]
        out["answer_recall"] = {str(k): v for k, v in
                                answer_recall_at_k(texts, [data.answers[i] for i in answered], ks).items()}
    return out


def evaluate_retrieval(model: nn.Module, corpus: Corpus, sets: dict[str, EvalSet], ks: list[int],
                       accelerator: Accelerator, batch_size: int) -> dict[str, dict]:
    """Embed the whole corpus with `model` now (each process its share), rank every set, compute metrics."""
    vectors, offset = embed_local_shard(model, corpus, accelerator, batch_size)
    k = min(max(ks), len(corpus))
    return {name: retrieval_metrics(corpus, rank_passages(model, vectors, offset, data.questions, k, batch_size),
                                    data, ks)
            for name, data in sets.items()}

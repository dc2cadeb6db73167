"""Open-domain QA evaluation: retrieve with the current retriever over a corpus it embedded, read with
FiD, score exact match (SQuAD/DPR normalisation) and answer recall@k; predictions as JSONL rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from rag_train.buffer.embed import embed_local_shard
from rag_train.data.collate import fid_inputs
from rag_train.data.corpus import Corpus
from rag_train.data.qa import QAExample
from rag_train.eval.metrics import answer_recall_at_k, exact_match
from rag_train.eval.retrieval import rank_passages

EMPTY_PASSAGE = {"title": "", "text": ""}  # closed book: the reader sees the question alone


@dataclass
class QAEvalSettings:
    num_passages: int
    max_input_length: int
    max_answer_length: int
    batch_size: int
    closed_book: bool = False


@torch.no_grad()
def evaluate_qa(retriever: nn.Module, reader: nn.Module, tokenizer, corpus: Corpus, sets: dict[str, list[QAExample]],
                settings: QAEvalSettings, accelerator: Accelerator) -> tuple[dict, dict[str, list[dict]]]:
    """Metrics per set ({"em", "answer_recall@k"}) and predictions per set. Every process computes the
    retrieval share it owns; generation runs on every process for all questions (cheap at toy scale,
    and it keeps the metrics identical on all processes)."""
    k = settings.num_passages
    vectors = offset = None
    if not settings.closed_book:
        vectors, offset = embed_local_shard(retriever, corpus, accelerator, settings.batch_size)
    was_training = reader.training
    reader.eval()
    metrics, predictions = {}, {}
    for name, examples in sets.items():
        questions = [ex.question for ex in examples]
        if settings.closed_book:
            ranked = None
            passages = [[EMPTY_PASSAGE] for _ in examples]
        else:
            ranked = rank_passages(retriever, vectors, offset, questions, min(k, len(corpus)), settings.batch_size)
            passages = [corpus.passages(row) for row in ranked.tolist()]
        answers_out = []
        for start in tqdm(range(0, len(examples), settings.batch_size), desc=f"eval {name}", leave=False,
                          disable=not accelerator.is_main_process):
            batch = fid_inputs(tokenizer, questions[start : start + settings.batch_size],
                               passages[start : start + settings.batch_size], settings.max_input_length)
            generated = reader.generate(batch["input_ids"].to(accelerator.device),
                                        batch["attention_mask"].to(accelerator.device),
                                        max_new_tokens=settings.max_answer_length)
            answers_out += tokenizer.batch_decode(generated, skip_special_tokens=True)
        em = [exact_match(pred, ex.answers) for pred, ex in zip(answers_out, examples)]
        result = {"em": sum(em) / len(em), "questions": len(examples)}
        if ranked is not None:
            texts = [[p["text"] for p in ps] for ps in passages]
            result[f"answer_recall@{k}"] = answer_recall_at_k(texts, [ex.answers for ex in examples], [k])[k]
        metrics[name] = result
        predictions[name] = [
            {"id": ex.id, "question": ex.question, "answers": ex.answers, "prediction": pred, "em": score,
             "passages": [p.get("id") for p in ps] if ranked is not None else []}
            for ex, pred, score, ps in zip(examples, answers_out, em, passages)
        ]
    reader.train(was_training)
    return metrics, predictions

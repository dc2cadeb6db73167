"""Open-domain QA evaluation: retrieve with the current retriever over a corpus it embedded, read with
FiD, score exact match (SQuAD/DPR normalisation) and answer recall@k (plus the IR metrics of
`retrieval_metrics` when questions list gold passage ids); predictions as JSONL rows, rankings as TREC runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from rag_train.buffer.embed import embed_local_shard
from rag_train.data.collate import fid_inputs
from rag_train.data.corpus import Corpus
from rag_train.data.qa import QAExample
from rag_train.eval.metrics import exact_match
from rag_train.eval.retrieval import EvalSet, rank_passages, retrieval_metrics

EMPTY_PASSAGE = {"title": "", "text": ""}  # closed book: the reader sees the question alone


@dataclass
class QAEvalSettings:
    num_passages: int
    max_input_length: int
    max_answer_length: int
    batch_size: int
    closed_book: bool = False
    embed_workers: int = 0  # buffer.embed_workers for the corpus pass
    embed_batch_size: int = 256  # buffer.embed_batch_size for the corpus pass

    @classmethod
    def from_config(cls, cfg, closed_book: bool, num_passages: Optional[int] = None,
                    batch_size: Optional[int] = None) -> "QAEvalSettings":
        """The settings of an RLM config (its eval, strategy, reader and buffer sections): what the recipe's
        in-loop evaluations use and what scripts/evaluate.py uses on the finished run, unless overridden."""
        return cls(num_passages=num_passages or cfg.eval.num_passages or cfg.strategy.top_k,
                   max_input_length=cfg.reader.max_input_length, max_answer_length=cfg.reader.max_answer_length,
                   batch_size=batch_size or cfg.eval.batch_size, closed_book=closed_book,
                   embed_workers=cfg.buffer.embed_workers, embed_batch_size=cfg.buffer.embed_batch_size)


@torch.no_grad()
def evaluate_qa(retriever: nn.Module, reader: nn.Module, tokenizer, corpus: Corpus, sets: dict[str, list[QAExample]],
                settings: QAEvalSettings, accelerator: Accelerator,
                out_dir: Optional[Path] = None,
                shard: Optional[tuple[torch.Tensor, int]] = None) -> tuple[dict, dict[str, list[dict]]]:
    """Metrics per set ({"em", "answer_recall@k"}, and with gold passage ids "recall", "mrr@10", "ndcg@10",
    "map@k") and predictions per set. Every process computes the retrieval share it owns, over the corpus
    embedded now or over `shard` = (its passage vectors, first row) when given (the stale buffer: no corpus
    pass); generation runs on every process for all questions (cheap at toy scale, and it keeps the metrics
    identical on all processes). With `out_dir`, the main process writes each set's ranking as `<set>.trec`
    (and `<set>.qrels`) there."""
    k = settings.num_passages
    vectors = offset = None
    if not settings.closed_book:
        vectors, offset = shard or embed_local_shard(retriever, corpus, accelerator, settings.embed_batch_size,
                                                     num_workers=settings.embed_workers)
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
            passages = [corpus.passages(row) for row in ranked.rows.tolist()]
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
            labels = EvalSet(questions, [ex.id for ex in examples], [dict.fromkeys(ex.gold_ids, 1) for ex in examples],
                             [ex.answers for ex in examples])
            retrieval = retrieval_metrics(corpus, ranked, labels, [ranked.rows.shape[1]],
                                          out_dir if accelerator.is_main_process else None, name)
            depth = ranked.rows.shape[1]
            result[f"answer_recall@{k}"] = retrieval["answer_recall"][str(depth)]
            if "recall" in retrieval:  # flat keys; @10 metrics only where ten passages were ranked
                result[f"recall@{depth}"] = retrieval["recall"][str(depth)]
                result.update((key, value) for key, value in retrieval.items()
                              if key.startswith("map@") or (key.endswith("@10") and depth >= 10))
        metrics[name] = result
        predictions[name] = [
            {"id": ex.id, "question": ex.question, "answers": ex.answers, "prediction": pred, "em": score,
             "passages": [p.get("id") for p in ps] if ranked is not None else []}
            for ex, pred, score, ps in zip(examples, answers_out, em, passages)
        ]
    reader.train(was_training)
    return metrics, predictions

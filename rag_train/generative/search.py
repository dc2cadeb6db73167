"""Constrained beam search: each question's beams, read back as a ranking of distinct targets, and the metrics.

Beams are ranked by log P(t | q) = sum_i log P(t_i | q, t_<i) (Eq. 1 of seed 003; no length normalisation).
Every path the trie allows ends at a target, so a returned beam is a target unless the search ran out of valid
continuations (fewer targets than beams below some prefix): such beams end off the trie and are dropped.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import ir_measures
import torch
from ir_measures import Rprec
from tqdm.auto import tqdm

from rag_train.eval import metrics
from rag_train.generative.trie import Trie


@torch.no_grad()
def rank_targets(model, tokenizer, questions: Sequence[str], trie: Trie, end_ids: list[int], num_beams: int,
                 max_question_length: int, batch_size: int, progress: bool = False) -> list[list[int]]:
    """Target indices per question, best first (at most `num_beams`), from `model.generate` under `trie`."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    max_path = max(len(path) for path in trie.paths())
    start = model.config.decoder_start_token_id
    ranked: list[list[int]] = []
    for offset in tqdm(range(0, len(questions), batch_size), desc="beam search", disable=not progress, leave=False):
        batch = tokenizer(list(questions[offset:offset + batch_size]), padding=True, truncation=True,
                          max_length=max_question_length, return_tensors="pt").to(device)
        out = model.generate(**batch, num_beams=num_beams, num_return_sequences=num_beams, max_new_tokens=max_path,
                             prefix_allowed_tokens_fn=trie.prefix_allowed_tokens_fn(1, start), length_penalty=0.0,
                             early_stopping=True, eos_token_id=end_ids, pad_token_id=start,
                             decoder_start_token_id=start, do_sample=False, return_dict_in_generate=True,
                             output_scores=True)
        sequences = out.sequences[:, 1:].view(len(batch["input_ids"]), num_beams, -1).tolist()
        scores = out.sequences_scores.view(len(batch["input_ids"]), num_beams).tolist()
        ends = set(end_ids)
        for beams, beam_scores in zip(sequences, scores):
            found: list[int] = []
            for beam, score in sorted(zip(beams, beam_scores), key=lambda pair: -pair[1]):
                stop = next((i for i, token in enumerate(beam) if token in ends), None)
                target = None if stop is None or score == float("-inf") else trie.target(beam[: stop + 1])
                if target is not None and target not in found:
                    found.append(target)
            ranked.append(found)
    model.train(was_training)
    return ranked


def ranking_metrics(ranked: Sequence[Sequence[Hashable]], gold: Sequence[Sequence[Hashable]],
                    ks: Sequence[int]) -> dict:
    """R-precision (KILT's; with one gold target it is precision@1) and recall@k of target rankings against gold
    target sets, by ir_measures as the project's other retrieval metrics. A question whose beams held no target
    ranks one never-relevant placeholder, so it counts as a miss instead of being left out."""
    if len(ranked) != len(gold):
        raise ValueError(f"{len(ranked)} rankings but {len(gold)} gold sets")
    run = {str(q): {str(t): float(len(r) - j) for j, t in enumerate(r)} or {"\x00none": 0.0}
           for q, r in enumerate(ranked)}
    qrels = {str(q): {str(t): 1 for t in g} for q, g in enumerate(gold)}
    out = metrics.ranking_metrics(run, qrels, ks)
    return {"questions": len(ranked), "r_precision": ir_measures.calc_aggregate([Rprec], qrels, run)[Rprec],
            "recall": out["recall"], "mrr@10": out["mrr@10"]}

"""Tensors for the FiD reader: per-passage encoder inputs [B, P, L] and answer labels [B, T].

Inputs follow the FiD / Atlas convention "question: {q} title: {t} context: {text}". Every sequence
ends with the tokenizer's eos (T5 convention) whether or not the tokenizer's post-processor adds one,
so toy tokenizers and Hugging Face T5 tokenizers give the same layout.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

Passage = Union[dict, str]


def format_fid_input(question: str, passage: Passage) -> str:
    """One encoder input; a bare string passage has no title."""
    if isinstance(passage, str):
        return f"question: {question} context: {passage}"
    title = passage.get("title") or ""
    return f"question: {question} title: {title} context: {passage.get('text', '')}"


def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("the reader tokenizer needs eos and pad tokens (T5 style: pad=0, eos=1)")
    return tokenizer.eos_token_id


def _encode_with_eos(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    if max_length < 2:
        raise ValueError(f"max_length={max_length} leaves no room for a token and eos")
    eos = _eos_id(tokenizer)
    ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length - 1)["input_ids"]
    return [seq + [eos] for seq in ids]


def _pad(sequences: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(seq) for seq in sequences)
    out = torch.full((len(sequences), width), value, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def fid_inputs(
    tokenizer,
    questions: Sequence[str],
    passages_per_question: Sequence[Sequence[Passage]],
    max_length: int,
) -> dict[str, torch.Tensor]:
    """`input_ids` / `attention_mask` [B, P, L]: each (question, passage) truncated to `max_length`
    tokens (eos included) and right-padded to the longest in the batch. Every question needs P passages."""
    if len(questions) != len(passages_per_question):
        raise ValueError(f"{len(questions)} questions but {len(passages_per_question)} passage lists")
    if not questions:
        raise ValueError("fid_inputs needs at least one question")
    num_passages = len(passages_per_question[0])
    for i, passages in enumerate(passages_per_question):
        if len(passages) != num_passages or not passages:
            raise ValueError(
                f"question {i} has {len(passages)} passages; every question needs the same number (> 0), "
                f"question 0 has {num_passages}"
            )
    texts = [format_fid_input(q, p) for q, passages in zip(questions, passages_per_question) for p in passages]
    sequences = _encode_with_eos(tokenizer, texts, max_length)
    input_ids = _pad(sequences, tokenizer.pad_token_id)
    attention_mask = _pad([[1] * len(seq) for seq in sequences], 0)
    shape = (len(questions), num_passages, input_ids.shape[1])
    return {"input_ids": input_ids.view(shape), "attention_mask": attention_mask.view(shape)}


def choose_answer(answers: Union[str, Sequence[str]], generator: Optional[torch.Generator] = None) -> str:
    """The answer to train on: the first one, or a uniformly random one when a generator is given."""
    if isinstance(answers, str):
        return answers
    if len(answers) == 0:
        raise ValueError("a question has no answers to train on")
    if generator is None:
        return answers[0]
    return answers[int(torch.randint(len(answers), (1,), generator=generator))]


def answer_labels(
    tokenizer,
    answers: Sequence[Union[str, Sequence[str]]],
    max_length: int,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Decoder labels [B, T]: answer tokens + eos, truncated to `max_length`, padded with -100.

    An entry may be a list of acceptable answers; `choose_answer` picks one (see there)."""
    chosen = [choose_answer(a, generator) for a in answers]
    return _pad(_encode_with_eos(tokenizer, chosen, max_length), -100)

"""Retrieval targets and their identifiers: one target per distinct title (GENRE) or per passage (its id).

Each target keeps the corpus row whose text is its context for the CE encoder (a title's first passage: the
start of the article) and the identifier's tokens, which are both what the generator writes and the rows of the
encoder's input whose outputs become CE rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError
from rag_train.data.supervised import RetrievalExample


@dataclass
class Targets:
    names: list[str]  # identifier strings, target index order
    tokens: list[list[int]]  # identifier tokens, no end token
    context_rows: np.ndarray  # [targets] corpus row read as the target's context
    row_target: np.ndarray  # [corpus rows] target index of every passage
    fingerprint: str  # corpus fingerprint + identifier kind + tokens: what a CE table was built for

    def __len__(self) -> int:
        return len(self.names)

    def gold(self, corpus: Corpus, example: RetrievalExample) -> list[int]:
        """Target indices of an example's positive passages (distinct, in order)."""
        return list(dict.fromkeys(int(self.row_target[r]) for r in corpus.rows(example.positive_ids)))


def build_targets(corpus: Corpus, tokenizer, identifier: str, progress: bool = False) -> Targets:
    """Targets of `corpus` in row order of their first passage; DataError naming a row without an identifier."""
    index: dict[str, int] = {}
    context_rows: list[int] = []
    row_target = np.empty(len(corpus), dtype=np.int64)
    for row in tqdm(range(len(corpus)), desc="targets", disable=not progress, leave=False):
        name = corpus.title(row).strip() if identifier == "title" else corpus.id(row)
        if not name:
            raise DataError(f"{corpus.path}: passage {corpus.id(row)!r} (row {row}) has an empty title; "
                            "generative retrieval by title needs every passage titled (or targets.identifier=id)")
        target = index.setdefault(name, len(index))
        if target == len(context_rows):
            context_rows.append(row)
        row_target[row] = target
    names = list(index)
    tokens = [list(ids) for ids in tokenizer(names, add_special_tokens=False)["input_ids"]]
    empty = next((name for name, ids in zip(names, tokens) if not ids), None)
    if empty is not None:
        raise DataError(f"{corpus.path}: identifier {empty!r} tokenizes to nothing")
    digest = hashlib.sha256(json.dumps([corpus.fingerprint, identifier, tokens]).encode()).hexdigest()
    return Targets(names, tokens, np.asarray(context_rows, dtype=np.int64), row_target, digest)


def context_inputs(targets: Targets, corpus: Corpus, tokenizer, indices: Sequence[int], length: int) -> list[list[int]]:
    """Encoder inputs of targets: identifier tokens, the end token, then the passage text (its tokens, truncated so
    the whole input fits `length`). Ids are concatenated rather than re-tokenized from one string, so the first
    positions are exactly the identifier's tokens as the generator writes them."""
    eos = tokenizer.eos_token_id
    texts = [corpus.text(int(targets.context_rows[i])) for i in indices]
    text_ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    out = []
    for i, text in zip(indices, text_ids):
        head = targets.tokens[i] + [eos]
        out.append(head + text[: max(0, length - len(head))])
    return out

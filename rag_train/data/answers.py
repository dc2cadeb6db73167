"""SQuAD v1.1's answer normalisation (its official evaluation script, as FiD, Atlas and seed 000 use it): shared by
exact match (`rag_train.eval.metrics`) and the QA loaders, which report answers it leaves empty."""

from __future__ import annotations

import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation, drop articles a/an/the, collapse whitespace (SQuAD v1.1 order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())

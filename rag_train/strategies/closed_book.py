"""Closed book (Algorithm 2 baseline): the reader sees the question only, the lower bound on what retrieval adds."""

from __future__ import annotations

from rag_train.strategies.base import Strategy, register


@register
class ClosedBook(Strategy):
    name = "closed_book"
    algorithms = frozenset({2})
    retrieves = False
    trains_retriever = False

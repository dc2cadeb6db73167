"""Frozen retriever (Algorithm 2 baseline): passages from the stale buffer, with a retriever that never trains."""

from __future__ import annotations

from rag_train.strategies.base import register
from rag_train.strategies.stale import Stale


@register
class Frozen(Stale):
    name = "frozen"
    algorithms = frozenset({2})
    trains_retriever = False

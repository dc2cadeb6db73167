"""Passage-selection strategies behind one interface; `build_strategy` is the only place names are read."""

from rag_train.config import StrategyConfig
from rag_train.strategies.base import Strategy, StrategyContext, Subset
from rag_train.strategies.buffered import SNM, ClosedBook, Exhaustive, Frozen, Stale, Uniform
from rag_train.strategies.corrector import CorrectorStrategy
from rag_train.strategies.negative_cache import NegativeCache

REGISTRY: dict[str, type[Strategy]] = {
    "in_batch": Strategy,
    "uniform": Uniform,
    "stale": Stale,
    "frozen": Frozen,
    "exhaustive": Exhaustive,
    "snm": SNM,
    "negative_cache": NegativeCache,
    "corrector": CorrectorStrategy,
    "closed_book": ClosedBook,
}


def build_strategy(cfg: StrategyConfig, ctx: StrategyContext) -> Strategy:
    return REGISTRY[cfg.name](cfg, ctx)


__all__ = ["REGISTRY", "Strategy", "StrategyContext", "Subset", "build_strategy"]

"""Passage-selection strategies, one module each (see `base` for what a module declares).

Importing this package imports every module in it; each registers its strategy (`@register`). The registry
and the `strategy` config section follow from those declarations: `StrategyConfig` holds the keys every
strategy reads (`BaseStrategyConfig`) plus each strategy's own keys, spelled `strategy.<key>`, and validates the
selected strategy's keys with its own config class (`rag_train.config.plugin_section`, as for batching options).
Adding a strategy is adding one module (and its test).
`build_strategy` is the only place a name is read.
"""

from __future__ import annotations

from typing import Any

from rag_train.config import ConfigError, plugin_section
from rag_train.strategies.base import REGISTRY, BaseStrategyConfig, Strategy, StrategyContext, Subset, register

REGISTRY.discover(__name__, __path__)  # every module, each registering; then by name


def _corpus_limits(self) -> list[tuple[str, int]]:
    return self.selected().corpus_limits()


StrategyConfig, OWNERS = plugin_section(
    "strategy", BaseStrategyConfig, REGISTRY,
    "How the passage subset S_x is chosen (a strategy: one module of rag_train/strategies/).",
    namespace={"__module__": __name__, "corpus_limits": _corpus_limits})


def reads(name: str, key: str) -> bool:
    """False for a `strategy.<key>` that is another strategy's own key (strategy `name` would refuse it on the
    command line); True for every other config key. Drivers that pass one set of overrides to every strategy
    filter by it."""
    section, _, own = key.partition(".")
    return section != "strategy" or name in OWNERS.get(own.split(".")[0], (name,))


def overrides_read_by(name: str, overrides) -> list[str]:
    """The `key=value` overrides strategy `name` reads (`reads`), in order: what a driver passes it of a shared set."""
    return [item for item in overrides if reads(name, item.split("=", 1)[0])]


def require_algorithm(key: str, name: str, algorithm: int, recipe: str) -> None:
    """ConfigError naming `key` unless strategy `name` runs in `algorithm` (1: supervised retrieval, 2: the RLM)."""
    usable = tuple(name for name, cls in REGISTRY.items() if algorithm in cls.algorithms)
    if name not in usable:
        raise ConfigError(f"{key}={name!r} is not one of the strategies {recipe} (Algorithm {algorithm}) takes: "
                          f"{list(usable)}")


def require_search(name: str, search: str) -> None:
    """ConfigError unless strategy `name` supports `buffer.search=search` (strategies without an index read none)."""
    supported = REGISTRY[name].searches
    if supported and search not in supported:
        raise ConfigError(f"buffer.search={search!r}: strategy {name!r} searches with {sorted(supported)} only")


def strategy_class(name: str) -> type[Strategy]:
    """The registered strategy `name`: the one way the recipes read the registry (its declarations: needs_buffer,
    retrieves, algorithms, ...). `StrategyConfig` has already refused an unknown name with a ConfigError."""
    return REGISTRY[name]


def build_strategy(cfg: Any, ctx: StrategyContext) -> Strategy:
    """The strategy `cfg.name` (a `StrategyConfig`) with its own config."""
    return REGISTRY[cfg.name](cfg.selected(), ctx)


__all__ = ["OWNERS", "REGISTRY", "BaseStrategyConfig", "Strategy", "StrategyConfig", "StrategyContext", "Subset",
           "build_strategy", "register", "require_algorithm", "require_search", "strategy_class"]

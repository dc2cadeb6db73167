"""Passage-selection strategies, one module each (see `base` for what a module declares).

Importing this package imports every module in it; each registers its strategy (`@register`). The registry
and the `strategy` config section follow from those declarations: `StrategyConfig` holds the keys every
strategy reads (`BaseStrategyConfig`) plus each strategy's own keys, spelled `strategy.<key>`, and validates the
selected strategy's keys with its own config class. Adding a strategy is adding one module (and its test).
`build_strategy` is the only place a name is read.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from typing import Any

from rag_train.config import ConfigError, check_choice
from rag_train.strategies.base import REGISTRY, BaseStrategyConfig, Strategy, StrategyContext, Subset, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
_registered = sorted(REGISTRY.items())  # by name, whatever order the modules import each other in
REGISTRY.clear()
REGISTRY.update(_registered)


def _default(spec: dataclasses.Field) -> Any:
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def _section_fields() -> tuple[list[tuple[str, Any, dataclasses.Field]], dict[str, tuple[str, ...]]]:
    """The fields of the `strategy` section (common keys first, then each strategy's own, once each) and, per
    own key, the strategies that read it. A key declared by several strategies (`refresh_every`) is one key:
    its type and default must agree."""
    found: dict[str, tuple[Any, dataclasses.Field, str]] = {}
    owners: dict[str, list[str]] = {}
    common = {spec.name for spec in dataclasses.fields(BaseStrategyConfig)}
    for name, cls in [("", Strategy), *REGISTRY.items()]:
        types = typing.get_type_hints(cls.config)
        for spec in dataclasses.fields(cls.config):
            if spec.name not in common:
                owners.setdefault(spec.name, []).append(name)
            if spec.name not in found:
                found[spec.name] = (types[spec.name], spec, name)
                continue
            kind, first, first_owner = found[spec.name]
            if kind != types[spec.name] or _default(first) != _default(spec):
                raise TypeError(f"strategy key {spec.name!r} is declared differently by {first_owner!r} and {name!r} "
                                "(type or default): strategies that share a key must agree on it")
    fields = [(key, kind, dataclasses.field(default_factory=spec.default_factory)
               if spec.default_factory is not dataclasses.MISSING else dataclasses.field(default=spec.default))
              for key, (kind, spec, _) in found.items()]
    return fields, {key: tuple(names) for key, names in owners.items()}


_FIELDS, OWNERS = _section_fields()


def reads(name: str, key: str) -> bool:
    """False for a `strategy.<key>` that is another strategy's own key (strategy `name` would warn that it does not
    read it); True for every other config key. Drivers that pass one set of overrides to every strategy filter by it."""
    section, _, own = key.partition(".")
    return section != "strategy" or name in OWNERS.get(own.split(".")[0], (name,))


def _check(self) -> None:
    check_choice("strategy", "name", self.name, tuple(REGISTRY))
    self.selected()


def _selected(self) -> BaseStrategyConfig:
    """The selected strategy's own config: its keys, validated by its config class."""
    own = REGISTRY[self.name].config
    return own(**{spec.name: getattr(self, spec.name) for spec in dataclasses.fields(own)})


def _unread_keys(self) -> dict[str, str]:
    """Keys of other strategies, which the selected one ignores: {key: why} (config.load_config warns when
    one is set on the command line)."""
    reads = {spec.name for spec in dataclasses.fields(REGISTRY[self.name].config)}
    return {key: f"strategy {self.name!r} does not read strategy.{key} (a key of {', '.join(names)})"
            for key, names in OWNERS.items() if key not in reads}


def _corpus_limits(self) -> list[tuple[str, int]]:
    return self.selected().corpus_limits()


def _document() -> str:
    lines = ["How the passage subset S_x is chosen: `strategy.name` picks a registered strategy, which reads the",
             "common keys (name, top_k, uniform_negatives) and its own:"]
    for name, cls in REGISTRY.items():
        own = [spec.name for spec in dataclasses.fields(cls.config) if spec.name in OWNERS]
        lines.append(f"  {name}: {', '.join(own) or '-'}  ({cls.__module__})")
    return "\n".join(lines)


StrategyConfig = dataclasses.make_dataclass(
    "StrategyConfig", _FIELDS,
    namespace={"__module__": __name__, "__post_init__": _check, "selected": _selected, "unread_keys": _unread_keys,
               "corpus_limits": _corpus_limits, "__doc__": _document()})


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

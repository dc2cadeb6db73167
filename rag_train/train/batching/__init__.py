"""Options of Algorithm 1's recipe for large effective batches under a memory cap (`batching.name`, seed 002).

Each option is one module of this package exporting `OPTION`, a `BatchingOption` subclass that declares its
name, the `batching.*` keys it reads and the strategies it takes; the registry below is derived from the
modules, and nothing outside them reads an option's name. Adding one is one new file.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import fields

from rag_train.config import BatchingConfig, ConfigError
from rag_train.strategies.base import Strategy
from rag_train.train.batching.base import BatchingOption, MicroBatch, StepParts, StepResult, tower_grad_norms


def _discover() -> dict[str, type[BatchingOption]]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        option = getattr(module, "OPTION", None)
        if option is not None:
            found[option.name] = option
    return found


OPTIONS: dict[str, type[BatchingOption]] = _discover()


def check_batching(cfg: BatchingConfig, strategy: type[Strategy], batch_size: int, world: int) -> type[BatchingOption]:
    """The option `cfg.name` names, after checking the combination (ConfigError naming the key): a known name,
    no key set that the option does not read, K micro-batches that split the global batch evenly over the
    processes, and the option's own limits (which strategies it takes)."""
    if cfg.name not in OPTIONS:
        raise ConfigError(f"batching.name={cfg.name!r} is not one of {sorted(OPTIONS)}")
    option = OPTIONS[cfg.name]
    defaults = BatchingConfig()
    for item in fields(BatchingConfig):
        key = item.name
        if key not in ("name", "memory_fraction") + option.keys and getattr(cfg, key) != getattr(defaults, key):
            readers = sorted(name for name, other in OPTIONS.items() if key in other.keys)
            raise ConfigError(f"batching.{key}={getattr(cfg, key)!r} is not read by batching.name={cfg.name!r} "
                              f"(only by {', '.join(readers)}); leave it at its default {getattr(defaults, key)!r}")
    if batch_size % (cfg.micro_batches * world):
        raise ConfigError(f"train.batch_size={batch_size} must be divisible by batching.micro_batches="
                          f"{cfg.micro_batches} x {world} process(es): each micro-batch is an equal share")
    if cfg.micro_batches < option.min_micro_batches:
        raise ConfigError(f"batching.name={cfg.name} needs batching.micro_batches >= {option.min_micro_batches} "
                          "(K = 1 is plain)")
    option.check(cfg, strategy, world)
    return option


__all__ = ["OPTIONS", "BatchingOption", "MicroBatch", "StepParts", "StepResult", "check_batching", "tower_grad_norms"]

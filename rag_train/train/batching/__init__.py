"""Options of Algorithm 1's recipe for large effective batches under a memory cap (`batching.name`, seed 002).

Each option is one module of this package: a `BatchingOption` subclass registered with `@register` (the pattern
of the strategies: `rag_train.plugins.Registry`), declaring its name, its own config class (the `batching.*` keys it
reads) and the strategies it takes. Importing this package imports every module in it; the registry (`REGISTRY`)
and the `batching` config section (`BatchingConfig`, built by `rag_train.config.plugin_section` as the strategy
section is) are derived from the modules, and nothing outside them reads an option's name. Adding one is one new
file.
"""

from __future__ import annotations

from rag_train.config import ConfigError, plugin_section
from rag_train.strategies.base import Strategy
from rag_train.train.batching.base import (
    REGISTRY,
    BaseBatchingConfig,
    BatchingOption,
    MicroBatch,
    StepParts,
    StepResult,
    register,
    tower_grad_norms,
)

REGISTRY.discover(__name__, __path__)  # every module, each registering its option; then by name
BatchingConfig, OWNERS = plugin_section(
    "batching", BaseBatchingConfig, REGISTRY,
    "How Algorithm 1 turns one optimizer step's global batch into a gradient under a memory cap (seed 002; an "
    "option: one module of rag_train/train/batching/).\n" + "\n".join(
        f"  {name}: {' '.join(option.__doc__.split())}" for name, option in REGISTRY.items()),
    namespace={"__module__": __name__})


def check_batching(cfg: BaseBatchingConfig, strategy: type[Strategy], batch_size: int,
                   world: int) -> type[BatchingOption]:
    """The option `cfg.name` names, after checking the combination (ConfigError naming the key): no key set that
    the option does not read (from the YAML file too: only keys of strategies may be set for all of them), K
    micro-batches that split the global batch evenly over the processes, and the option's own limits (which
    strategies it takes). `cfg` is the `batching` section (`BatchingConfig`), whose name is already checked."""
    option = REGISTRY[cfg.name]
    defaults = BatchingConfig()
    for key in cfg.unread_keys():
        if getattr(cfg, key) != getattr(defaults, key):
            raise ConfigError(f"batching.{key}={getattr(cfg, key)!r} is not read by batching.name={cfg.name!r} "
                              f"(only by {', '.join(OWNERS[key])}); leave it at its default {getattr(defaults, key)!r}")
    if batch_size % (cfg.micro_batches * world):
        raise ConfigError(f"train.batch_size={batch_size} must be divisible by batching.micro_batches="
                          f"{cfg.micro_batches} x {world} process(es): each micro-batch is an equal share")
    if cfg.micro_batches < option.min_micro_batches:
        raise ConfigError(f"batching.name={cfg.name} needs batching.micro_batches >= {option.min_micro_batches} "
                          "(K = 1 is plain)")
    option.check(cfg.selected(), strategy, world)
    return option


__all__ = ["OWNERS", "REGISTRY", "BaseBatchingConfig", "BatchingConfig", "BatchingOption", "MicroBatch", "StepParts",
           "StepResult", "check_batching", "register", "tower_grad_norms"]

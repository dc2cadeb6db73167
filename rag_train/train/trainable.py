"""The one module each recipe trains (`Trainable`: reader, retriever, the strategy's corrector, prepared once
with one optimizer) and what running it under DeepSpeed ZeRO needs: the config check, `full_weights` for
work outside its forward, and `save_parts` to save its parts with their full weights."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from accelerate import Accelerator

from rag_train.config import ConfigError


class Trainable(torch.nn.Module):
    """Everything a recipe trains (reader, retriever, the strategy's corrector), as ONE module that is prepared
    once with ONE optimizer whose param groups keep their own learning rates: accelerate's DeepSpeed
    integration runs one engine per model (and DDP then makes one gradient reduction per step).

    `model(fn, *args)` runs `fn(unwrapped_model, *args)` as the prepared module's forward. The part of a step
    that has a gradient goes through it: DDP expects one forward per backward and reduces the gradients of
    every part (parts without a gradient in some steps need `find_unused_parameters`); under ZeRO-3 each
    submodule gathers its weights as it runs. Work without a gradient may call the submodules directly when
    every process makes the same calls (ZeRO-3 then gathers in lockstep); work that differs between
    processes, or that reads weights outside a forward (search through the corrector, re-embedding the
    corpus, evaluation, generation), runs inside `full_weights`."""

    def __init__(self, **parts: torch.nn.Module):
        super().__init__()
        for name, part in parts.items():
            self.add_module(name, part)

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)


def deepspeed_stage(accelerator: Accelerator) -> Optional[int]:
    """The ZeRO stage of a DeepSpeed launch; None without DeepSpeed."""
    plugin = accelerator.state.deepspeed_plugin
    return None if plugin is None else int(plugin.zero_stage)


def check_deepspeed_config(accelerator: Accelerator) -> None:
    """ConfigError, before any work, for DeepSpeed settings the recipes cannot honour."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    where = "(see configs/accelerate/deepspeed_zero3.yaml)"
    if plugin.zero3_init_flag:
        raise ConfigError(f"DeepSpeed zero3_init_flag must be false {where}: the models are built, warm-started and "
                          "embed the stale buffer before they are prepared, so they must not be partitioned when built")
    if int(plugin.zero_stage) == 3 and not plugin.zero3_save_16bit_model:
        raise ConfigError(f"DeepSpeed ZeRO-3 needs zero3_save_16bit_model: true {where}: the trained reader and "
                          "retriever are saved from accelerator.get_state_dict, which gathers the shards only with it")
    config = plugin.deepspeed_config
    if config.get("gradient_accumulation_steps", 1) not in (1, "auto"):
        raise ConfigError("DeepSpeed gradient_accumulation_steps must be 1: train.batch_size is the global batch of "
                          "one optimizer step")
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise ConfigError(f"remove the {section!r} section from the DeepSpeed config: the recipes build their own "
                              "AdamW (per-group learning rates) and warm-up schedule")


@contextlib.contextmanager
def full_weights(accelerator: Accelerator, prepared: torch.nn.Module, *parts: torch.nn.Module) -> Iterator[None]:
    """While inside, `parts` (submodules of the prepared module) hold their full weights on every process and
    may run any number of forwards, or have their weights read directly, independently on each process.

    Under ZeRO-3 their shards are gathered (`deepspeed.zero.GatheredParameters`) and the engine's
    parameter hooks are lifted for the duration, as DeepSpeed's own `unwrap_model_for_generation` does for a
    whole model; they are partitioned again on exit. Every process must enter it (the gather is a
    collective). A no-op without ZeRO-3, where every process holds the full weights anyway."""
    if deepspeed_stage(accelerator) != 3:
        yield
        return
    import deepspeed

    offload = getattr(prepared.optimizer, "parameter_offload", prepared.optimizer)
    params = list(dict.fromkeys(p for part in parts for p in part.parameters()))  # shared towers: once
    with deepspeed.zero.GatheredParameters(params):
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def holding_weights(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """`module` holding the weights of `state` while inside. A ZeRO-3 partitioned parameter (an empty shard
    outside a forward) holds the full tensor for the duration and gets its shard back on exit; otherwise
    `state` is loaded as it is (there it is the module's own weights)."""
    partitioned = {name: p for name, p in module.named_parameters() if hasattr(p, "ds_shape")}
    if not partitioned:
        module.load_state_dict(state)
        yield
        return
    shards = {}
    try:
        for name, param in partitioned.items():
            shards[name] = param.data
            param.data = state[name].to(param.device, param.dtype).view(param.ds_shape)
        yield
    finally:
        for name, shard in shards.items():
            partitioned[name].data = shard


def save_parts(accelerator: Accelerator, prepared: torch.nn.Module,
               saves: dict[str, Callable[[torch.nn.Module], None]]) -> None:
    """Save parts of the prepared `Trainable` with their full weights, e.g. {"reader": save_reader, ...}.
    The weights come from `accelerator.get_state_dict` on every process (ZeRO-3: gathered from the shards into
    the main process, which needs zero3_save_16bit_model); then `save(part)` runs on the main process with
    them in the part."""
    state = accelerator.get_state_dict(prepared)
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(prepared)
        for name, save in saves.items():
            prefix = f"{name}."
            with holding_weights(getattr(model, name), {k[len(prefix):]: v for k, v in state.items()
                                                       if k.startswith(prefix)}):
                save(getattr(model, name))
    accelerator.wait_for_everyone()

"""Which attention kernel a T5 runs: eager wherever measured faster, transformers' choice (SDPA) elsewhere.

T5 always adds a float bias to its attention scores (the relative position bias). transformers hands SDPA that bias
as a float mask, rebuilt as [B, H, L, L] from bias and padding in every layer; no fused kernel wins that back.
* CPU, forward + backward (`python scripts/bench_attention.py`, two threads, the same weights both ways;
  docs/rlm_toy.md): eager 1.15-1.20x faster at the toy towers' and reader's sizes (d 64, d 128), 1.02-1.10x from
  d 256 to T5-base. Every T5 of a process that runs on CPU runs eager (`eager_t5_attention_on_cpu`), on a GPU
  machine too.
* CUDA, the encoder's forward without gradient under bf16 autocast, as `embed_rows` runs it (one H200, T5-base
  shape, 1,024 rows with half of them padded, interleaved rounds; docs/gpu_report.md): eager
  1.29x faster at 256 tokens (475 against 613 ms), 1.18x at 64. The corpus passes run eager
  (`PASS_ATTENTION` in `buffer/embed.py`). Training steps on CUDA keep SDPA: not measured there.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def t5_configs(model: nn.Module) -> list:
    """The config of every T5 module inside `model` (the model's own, its stacks', its attention layers')."""
    return [module.config for module in model.modules()
            if getattr(getattr(module, "config", None), "model_type", None) == "t5"]


def set_t5_attention(model: nn.Module, kernel: str) -> nn.Module:
    """Every T5 inside `model` runs `kernel` ("eager", "sdpa"); returns `model`. The config attribute is read at every
    forward; `set_attn_implementation` would refuse a subclass defined outside transformers (FiDReader) with a log
    line, and older transformers lack it."""
    for config in t5_configs(model):
        config._attn_implementation = kernel
    return model


def runs_on_cuda() -> bool:
    """Whether this process's models will run on CUDA: torch sees a device and accelerate was not told to use the CPU
    (`accelerate launch --cpu` and every run `reproduce.py` / `compare_*.py` launch set ACCELERATE_USE_CPU, also on a
    GPU machine)."""
    from accelerate.utils import parse_flag_from_env

    return torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")


def eager_t5_attention_on_cpu(model: nn.Module) -> nn.Module:
    """Switch every T5 inside `model` (a reader, a sentence-transformers tower, ...) to eager attention when
    its process runs on CPU (`runs_on_cuda`); returns `model`. The switch is not saved: a reloaded model passes
    through here again where this project loads it."""
    return model if runs_on_cuda() else set_t5_attention(model, "eager")


@contextlib.contextmanager
def t5_attention(model: nn.Module, kernel: str):
    """Every T5 inside `model` runs `kernel` inside the block and what it ran before after it."""
    configs = t5_configs(model)
    before = [config._attn_implementation for config in configs]
    set_t5_attention(model, kernel)
    try:
        yield model
    finally:
        for config, kernel_before in zip(configs, before):
            config._attn_implementation = kernel_before

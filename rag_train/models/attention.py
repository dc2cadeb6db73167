"""Which attention kernel a T5 runs: eager where no CUDA device is, transformers' choice (SDPA) where one is.

T5 always adds a float bias to its attention scores (the relative position bias). torch's CPU SDPA has no fused
kernel for an additive float mask: transformers materialises bias + padding mask as [B, H, L, L] and SDPA's
fallback adds a fully-masked-row check over it (isneginf / all / where), while computing what eager computes.
`python scripts/bench_attention.py` (forward + backward of a T5 encoder, two threads, the same weights both ways;
docs/rlm_toy.md): eager 1.15-1.20x faster at the toy towers' and reader's sizes (d 64, d 128), 1.02-1.10x from
d 256 to T5-base. On CUDA, SDPA's memory-efficient kernel takes the bias, so the model keeps what transformers
picked.
"""

from __future__ import annotations

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


def eager_t5_attention_on_cpu(model: nn.Module) -> nn.Module:
    """Switch every T5 inside `model` (a reader, a sentence-transformers tower, ...) to eager attention when
    torch sees no CUDA device; returns `model`. The switch is not saved: a reloaded model passes through here
    again where this project loads it."""
    return model if torch.cuda.is_available() else set_t5_attention(model, "eager")

"""Which attention kernel a T5 runs: eager where no CUDA device is, transformers' choice (SDPA) where one is.

T5 always adds a float bias to its attention scores (the relative position bias). torch's CPU SDPA has no fused
kernel for an additive float mask: transformers materialises bias + padding mask as [B, H, L, L] and SDPA's
fallback adds a fully-masked-row check over it (isneginf / all / where). Forward + backward of a two-layer T5
encoder, two threads, 2-core VM (docs/rlm_toy.md): eager 1.25x faster at d 64 and 1.20x at d 128 (the toy
towers and reader), 1.04-1.08x at d 256-512, 0.96-1.04x at d 768 (T5-base). On CUDA, SDPA's memory-efficient
kernel takes the bias, so the model keeps what transformers picked.
"""

from __future__ import annotations

import torch
from torch import nn


def eager_t5_attention_on_cpu(model: nn.Module) -> nn.Module:
    """Switch every T5 inside `model` (a reader, a sentence-transformers tower, ...) to eager attention when
    torch sees no CUDA device; returns `model`. The switch is not saved: a reloaded model passes through here
    again where this project loads it."""
    if torch.cuda.is_available():
        return model
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "model_type", None) == "t5":
            # the config attribute, read at every forward; `set_attn_implementation` would refuse a subclass
            # defined outside transformers (FiDReader) with a log line, and older transformers lack it
            config._attn_implementation = "eager"
    return model

"""Which attention kernel a T5 runs: eager wherever measured faster, transformers' choice (SDPA) elsewhere, and
FlexAttention (`models/fast_t5.py`) for the retriever's towers where `retriever.encoder_kernel` picks it.

T5 always adds a float bias to its attention scores (the relative position bias). transformers hands SDPA that bias
as a float mask, rebuilt as [B, H, L, L] from bias and padding in every layer; no fused kernel wins that back.
* CPU, forward + backward (`python scripts/bench_attention.py`, two threads, the same weights both ways;
  docs/rlm_toy_log.md): eager 1.15-1.20x faster at the toy towers' and reader's sizes (d 64, d 128), 1.02-1.10x from
  d 256 to T5-base. Every T5 of a process that runs on CPU runs eager (`eager_t5_attention_on_cpu`), on a GPU
  machine too.
* CUDA, the encoder's forward without gradient under bf16 autocast, as `embed_rows` runs it (one H200, T5-base
  shape, 1,024 rows with half of them padded, interleaved rounds; docs/generated/gpu_report.md): eager
  1.29x faster at 256 tokens (475 against 613 ms), 1.18x at 64. The corpus passes run eager
  (`pass_attention`). Training steps on CUDA keep SDPA: not measured there.
* FlexAttention fuses the bias and the padding into one kernel (on an H100 the forward of a base-shaped tower at
  256 tokens was 71-78% elementwise work, much of it the [B, H, L, L] fp32 scores and bias). `retriever.encoder_kernel`:
  `auto` keeps the kernels above everywhere until a GPU session has measured flex faster with a bounded number of
  compiles over a real pass's batch lengths (docs/generated/gpu_report.md, the embed stage); `flex` runs it for the
  corpus pass and training (CUDA, towers without dropout), `eager` nowhere.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rag_train.config import ConfigError
from rag_train.models.fast_t5 import FLEX

ENCODER_KERNELS = ("auto", "eager", "flex")  # retriever.encoder_kernel


def t5_configs(model: nn.Module) -> list:
    """The config of every T5 module inside `model` (the model's own, its stacks', its attention layers')."""
    return [module.config for module in model.modules()
            if getattr(getattr(module, "config", None), "model_type", None) == "t5"]


def set_t5_attention(model: nn.Module, kernel: str) -> nn.Module:
    """Every T5 inside `model` runs `kernel` ("eager", "sdpa", FLEX); returns `model`. The config attribute is read at
    every forward; `set_attn_implementation` would refuse a subclass defined outside transformers (FiDReader) with a
    log line, and older transformers lack it."""
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


def pass_attention(encoder_kernel: str, device: torch.device) -> str:
    """The kernel a corpus pass (`embed_rows`, no gradient) runs the towers' T5s on for `retriever.encoder_kernel`
    on `device`: FLEX for flex; eager otherwise (measured faster than SDPA above; flex's speed on `device` is not)."""
    return FLEX if encoder_kernel == "flex" else "eager"


def use_encoder_kernel(model: nn.Module, encoder_kernel: str) -> nn.Module:
    """Every T5 inside `model` (the retriever's towers) trains and encodes on `retriever.encoder_kernel`: auto =
    `eager_t5_attention_on_cpu`; returns `model`. ConfigError where flex cannot train: on CPU (torch's
    FlexAttention has no backward there) and for a T5 with dropout (it cannot drop attention probabilities)."""
    if encoder_kernel not in ENCODER_KERNELS:
        raise ConfigError(f"retriever.encoder_kernel={encoder_kernel!r} is not one of {list(ENCODER_KERNELS)}")
    if encoder_kernel == "auto":
        return eager_t5_attention_on_cpu(model)
    if encoder_kernel == "flex":
        if not runs_on_cuda():
            raise ConfigError("retriever.encoder_kernel=flex: torch's FlexAttention has no backward on CPU; use auto "
                              "or eager on CPU")
        dropout = max((float(config.dropout_rate) for config in t5_configs(model)), default=0.0)
        if dropout > 0:
            raise ConfigError(f"retriever.encoder_kernel=flex: the towers' T5 has dropout_rate {dropout}, which "
                              "FlexAttention cannot apply to attention probabilities; use auto or eager, or a "
                              "checkpoint with dropout_rate 0")
    return set_t5_attention(model, FLEX if encoder_kernel == "flex" else "eager")

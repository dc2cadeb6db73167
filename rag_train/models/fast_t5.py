"""T5's encoder attention on torch's FlexAttention: the relative position bias and the padding mask applied inside
one fused kernel instead of as [B, H, L, L] fp32 tensors.

The same weights run through transformers' own `T5Attention` and `T5Stack`: only the attention call is swapped, by
registering `FLEX` with transformers' attention and mask interfaces and naming it in the T5 config
(`models/attention.py: set_t5_attention`). transformers 5.24 offers `attn_implementation="flex_attention"` for T5,
but its score_mod reads the [1, H, L, L] bias at the batch index, out of bounds for every row after the first (an
index error on CPU, a wrong read on CUDA), and it reads L x L bias values where 2L - 1 per head say the same.

* The bias: T5's bias depends only on the offset k - q, so the [1, H, L, L] bias transformers computes once per
  forward (layer 0, shared by every layer) is cut down to one row of 2L - 1 values per head, and the score_mod adds
  `table[h, k - q + L - 1]`. Its gradient flows back through the cut into `relative_attention_bias`.
* The mask: a `BlockMask` built from the padding mask's per-block counts (no L x L evaluation): blocks of only real
  keys run without a mask_mod, blocks of only padding are skipped, the rest read the padding mask.
* Compilation: on CUDA `flex_attention` runs through `torch.compile` (without it torch runs an unfused reference
  that materialises the scores). On CPU the uncompiled reference runs: the same numbers (the tests check it against
  eager); torch's compiled CPU kernel agreed at one length (1e-6) but gave NaN after recompiling for dynamic lengths
  (torch 2.13), and CPU passes default to eager anyway.
* Limits, from torch: no attention-probability dropout (a T5 with dropout_rate > 0 trains on another kernel) and no
  backward on CPU; `models/attention.py: use_encoder_kernel` says so before a run starts.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

FLEX = "rag_t5_flex"  # the attention implementation's name in transformers' registries and a T5 config
BLOCK = 128  # FlexAttention's default block size: the BlockMask is cut into blocks of this many queries / keys
UNCOMPILED_WARNING = "flex_attention called without torch.compile"


@functools.cache
def compiled_flex_attention():
    """`flex_attention` compiled once per process (the fused Triton kernel on CUDA), as transformers compiles it:
    the first shape static, then one graph dynamic in batch and length, so the varied batches of a corpus pass do not
    reach torch's recompile limit (past it torch would run the unfused reference, silently slow)."""
    return torch.compile(flex_attention)


def offset_table(position_bias: torch.Tensor) -> torch.Tensor:
    """[H, 2L - 1]: the bias of offset d = k - q at index d + L - 1, cut from T5's [1, H, L, L] bias (whose value
    depends only on k - q): offsets below zero from the first key column, the rest from the first query row."""
    return torch.cat([position_bias[0, :, 1:, 0].flip(-1), position_bias[0, :, 0, :]], dim=-1)


def relative_bias_score_mod(table: torch.Tensor):
    """A score_mod adding `table[h, k - q + L - 1]`; the index is clamped because the fused kernel may ask for
    positions past L in a block's tail (their scores are masked). The width is read from the tensor inside, not
    closed over as a Python int, so that a new length is a new size, not a new constant to recompile for."""

    def score_mod(score, batch, head, q_idx, kv_idx):
        width = table.size(-1)
        return score + table[head, torch.clamp(kv_idx - q_idx + (width - 1) // 2, 0, width - 1)]

    return score_mod


def padding_block_mask(attention_mask: torch.Tensor) -> BlockMask:
    """A BlockMask letting every query attend to the real keys of its row (`attention_mask` [B, L], 1 = real, any
    padding side), built from per-block counts of real keys."""
    batch, length = attention_mask.shape
    blocks = -(-length // BLOCK)
    real = nn.functional.pad(attention_mask.bool(), (0, blocks * BLOCK - length))
    counts = real.view(batch, blocks, BLOCK).sum(-1)

    def listed(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(how many, which) kv blocks each query block visits: the chosen blocks first, as BlockMask reads them."""
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        number = chosen.sum(-1, dtype=torch.int32)
        return (number[:, None, None].expand(batch, 1, blocks).contiguous(),
                order[:, None, None, :].expand(batch, 1, blocks, blocks).contiguous())

    def mask_mod(b, h, q_idx, kv_idx):
        return real[b, kv_idx]

    full = counts == BLOCK
    return BlockMask.from_kv_blocks(*listed((counts > 0) & ~full), *listed(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(length, length))


def padding_mask(batch_size: int, q_length: int, kv_length: int, attention_mask=None, **_) -> BlockMask | None:
    """transformers' mask interface for FLEX (T5Stack builds its mask through it): the padding BlockMask of the 2D
    mask. Also when nothing is padded: asking would wait for the device, and blocks of only real keys cost nothing."""
    if attention_mask is None:
        return None
    if q_length != kv_length or attention_mask.shape != (batch_size, kv_length):
        raise ValueError(f"{FLEX} runs T5's encoder self-attention only (a [batch, length] padding mask), "
                         f"not q_length {q_length} against kv_length {kv_length}")
    return padding_block_mask(attention_mask)


def t5_flex_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: BlockMask | None, scaling: float | None = None, dropout: float = 0.0,
                      position_bias: torch.Tensor | None = None, **_) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for FLEX: T5Attention's eager attention (scores + position bias + padding,
    softmax, values) as one FlexAttention call; returns ([B, L, H, D], no weights) like eager."""
    if dropout > 0:
        raise ValueError(f"{FLEX}: FlexAttention cannot drop attention probabilities (dropout {dropout}); "
                         "run this T5 on another kernel while it trains")
    if position_bias is None or position_bias.shape[0] != 1 or query.shape[-2] != key.shape[-2]:
        raise ValueError(f"{FLEX} runs T5's encoder self-attention only (one relative position bias for the batch)")
    score_mod = relative_bias_score_mod(offset_table(position_bias))
    if query.device.type == "cuda":
        out = compiled_flex_attention()(query, key, value, score_mod=score_mod, block_mask=attention_mask,
                                        scale=scaling)
    else:
        with warnings.catch_warnings():  # the reference is the point on CPU, not a slip
            warnings.filterwarnings("ignore", message=UNCOMPILED_WARNING)
            out = flex_attention(query, key, value, score_mod=score_mod, block_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX, t5_flex_attention)
AttentionMaskInterface.register(FLEX, padding_mask)

"""Configs for randomly initialised tiny T5s, so tests and the offline toy default need no downloaded weights."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase, T5Config

from rag_train.config import TinyModelConfig


def tiny_t5_config(
    tokenizer: PreTrainedTokenizerBase,
    tiny: TinyModelConfig,
    feed_forward_proj: str = "gated-gelu_pytorch_tanh",
    dropout_rate: float = 0.0,
    tie_word_embeddings: bool = True,
) -> T5Config:
    """A T5 config sized by `tiny`, with the vocabulary and special ids of `tokenizer`.

    Defaults follow T5 v1.1 / lm-adapt (gated-GELU feed-forward) so code paths match the real reader; its GELU is
    the same tanh approximation ("gelu_new") computed by torch's fused kernel, one op instead of six (the reader's
    warm-start step 4% faster on CPU; the name is saved in config.json, so a reloaded model computes the same).
    dropout is off because tiny models are trained for a few hundred steps where it only slows learning.
    Embeddings are tied (T5 v1.0 style: decoder output scaled by d_model**-0.5) so a randomly initialised
    model starts near uniform (loss ~ log vocab) instead of with huge logits from an untied N(0, 1) head.
    `tie_word_embeddings=False, dropout_rate=0.1` is T5 v1.1 / lm-adapt's own choice (the toy LM pre-training).
    """
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError("tokenizer needs pad and eos tokens for a T5 (pad doubles as decoder start)")
    return T5Config(
        vocab_size=len(tokenizer),
        d_model=tiny.d_model,
        d_ff=tiny.d_ff,
        d_kv=tiny.d_kv,
        num_heads=tiny.num_heads,
        num_layers=tiny.num_layers,
        num_decoder_layers=tiny.num_decoder_layers,
        feed_forward_proj=feed_forward_proj,
        dropout_rate=dropout_rate,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )

"""T5's encoder on FlexAttention (rag_train/models/fast_t5.py) against transformers' own eager T5, the same weights:
outputs (fp32, padding in the batch, lengths over one FlexAttention block, offsets past T5's last bucket) and every
weight's gradient; the corpus pass through `embed_rows` on it; and `retriever.encoder_kernel`'s choices."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from transformers import AttentionInterface, T5Config, T5EncoderModel

import rag_train.models.attention as attention
from rag_train.buffer.embed import embed_rows
from rag_train.config import ConfigError, RetrieverConfig, TinyModelConfig
from rag_train.models.attention import pass_attention, set_t5_attention, t5_configs
from rag_train.models.fast_t5 import BLOCK, FLEX, padding_mask
from rag_train.models.retriever import DualEncoder

LENGTH = BLOCK + 22  # two key blocks: one full, one partial; rows below fill one block partly and skip the other
REAL = (LENGTH, 70, 3)  # real tokens per row, right-padded


@pytest.fixture(scope="module")
def t5():
    """A tiny random T5 encoder whose 8 buckets end at distance 16, so most offsets share the far buckets."""
    torch.manual_seed(0)
    config = T5Config(vocab_size=100, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, dropout_rate=0.0,
                      feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                      relative_attention_max_distance=16)
    model = T5EncoderModel(config)
    ids = torch.randint(1, 100, (len(REAL), LENGTH))
    mask = (torch.arange(LENGTH) < torch.tensor(REAL)[:, None]).long()
    return model, ids, mask


def hidden(model, ids, mask, kernel: str) -> torch.Tensor:
    set_t5_attention(model, kernel)
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


def assert_close_to(ours: torch.Tensor, reference: torch.Tensor, relative: float) -> None:
    """Within `relative` of the reference's largest magnitude, element by element."""
    torch.testing.assert_close(ours, reference, rtol=relative, atol=relative * reference.abs().max().item())


def test_flex_forward_equals_transformers_eager(t5):
    model, ids, mask = t5
    with torch.no_grad():
        reference = hidden(model.eval(), ids, mask, "eager")
        ours = hidden(model, ids, mask, FLEX)
    assert_close_to(ours, reference, 1e-5)  # padded positions included: they attend to the real keys in both


def test_flex_gradients_equal_transformers_eager(t5, monkeypatch):
    """Every weight's gradient, the relative position bias's included (it reaches the table through the cut of
    `offset_table`). torch refuses FlexAttention's backward on CPU at its entry (its compiled CPU kernel has none);
    the reference implementation behind the entry differentiates, so the refusal is lifted here to check the
    score_mod and block mask's gradient path. The fused CUDA backward is left to a GPU session."""
    model, ids, mask = t5
    model.train()
    weights = torch.linspace(-1, 1, model.config.d_model)

    def gradients(kernel: str) -> dict[str, torch.Tensor]:
        model.zero_grad()
        (hidden(model, ids, mask, kernel) * mask[..., None] * weights).sum().backward()
        return {name: param.grad.clone() for name, param in model.named_parameters()}

    reference = gradients("eager")
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    with warnings.catch_warnings():  # dynamo asks the captured bias table (not a leaf: it carries the gradient) for
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")  # .grad
        ours = gradients(FLEX)
    assert reference["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].abs().max() > 0
    for name, grad in reference.items():
        assert_close_to(ours[name], grad, 1e-4)


def test_padding_mask_visits_the_blocks_with_real_keys(t5):
    _, _, mask = t5
    block_mask = padding_mask(len(REAL), LENGTH, LENGTH, attention_mask=mask)
    assert block_mask.to_dense()[:, 0, 0].tolist() == [[1, 1], [1, 0], [1, 0]]  # [rows, key blocks] visited
    assert block_mask.full_kv_num_blocks[:, 0, 0].tolist() == [1, 0, 0]  # only row 0's first block is all real
    assert padding_mask(len(REAL), LENGTH, LENGTH) is None
    with pytest.raises(ValueError, match="self-attention only"):
        padding_mask(len(REAL), 4, LENGTH, attention_mask=mask)


@pytest.fixture(scope="module")
def retriever(toy_world):
    cfg = RetrieverConfig(model="tiny", tiny=TinyModelConfig(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2),
                          projection_dim=16, max_passage_length=48)
    return DualEncoder.from_config(cfg, str(toy_world["tokenizer"])).eval()


def test_corpus_pass_on_flex_equals_the_eager_towers(retriever, toy_world, monkeypatch):
    """`embed_rows` with encoder_kernel=flex runs FlexAttention (counted) and gives the vectors the towers give on
    CPU's eager kernel; afterwards the towers are back on eager."""
    from rag_train.data.corpus import Corpus

    corpus = Corpus.open(toy_world["passages"])
    rows = np.arange(40)
    calls = []
    flex = AttentionInterface._global_mapping[FLEX]
    monkeypatch.setitem(AttentionInterface._global_mapping, FLEX, lambda *a, **k: calls.append(1) or flex(*a, **k))
    monkeypatch.setattr(retriever, "encoder_kernel", "flex")
    ours = embed_rows(retriever, corpus, rows, 16, torch.device("cpu"), num_workers=0)
    assert calls and {config._attn_implementation for config in t5_configs(retriever)} == {"eager"}
    with torch.inference_mode():
        reference = retriever.encode_passages(corpus.passages(rows))
    assert_close_to(ours, reference, 1e-5)


def test_encoder_kernel_choices(retriever, monkeypatch):
    """auto: today's kernels on CPU and CUDA (flex not measured on a GPU yet); flex refused where it cannot train."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [pass_attention(kernel, cpu) for kernel in ("auto", "eager", "flex")] == ["eager", "eager", FLEX]
    assert [pass_attention(kernel, cuda) for kernel in ("auto", "eager", "flex")] == ["eager", "eager", FLEX]
    assert retriever.encoder_kernel == "auto"
    assert {config._attn_implementation for config in t5_configs(retriever)} == {"eager"}
    with pytest.raises(ConfigError, match="retriever.encoder_kernel='fast' is not one of"):
        RetrieverConfig(encoder_kernel="fast")
    with pytest.raises(ConfigError, match="no backward on CPU"):
        attention.use_encoder_kernel(retriever, "flex")
    monkeypatch.setattr(attention, "runs_on_cuda", lambda: True)
    dropping = T5EncoderModel(T5Config(vocab_size=16, d_model=8, d_ff=8, d_kv=4, num_heads=2, num_layers=1,
                                       dropout_rate=0.1))
    with pytest.raises(ConfigError, match="dropout_rate 0.1"):
        attention.use_encoder_kernel(dropping, "flex")
    dropping.config.dropout_rate = dropping.encoder.config.dropout_rate = 0.0
    assert {config._attn_implementation for config in t5_configs(attention.use_encoder_kernel(dropping, "flex"))} \
        == {FLEX}

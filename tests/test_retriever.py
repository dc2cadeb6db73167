"""DualEncoder: tiny towers, shared vs separate, save/load, GTR-style and plain HF folders, offline failure."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rag_train.config import ConfigError, RetrieverConfig, TinyModelConfig
from rag_train.data.tokenizer import train_tokenizer
from rag_train.models.attention import set_t5_attention, t5_configs
from rag_train.models.retriever import DualEncoder, format_passage

TINY = TinyModelConfig(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=1)
QUESTIONS = ["who founded the city of varn", "what colour is the tower of ossa"]
PASSAGES = [{"title": "Varn", "text": "The city of Varn was founded by Elia Moor."},
            {"title": "Ossa", "text": "The tower of Ossa is painted green and blue."}, "a plain passage string"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [format_passage(p) for p in PASSAGES] + QUESTIONS
    texts += [f"entity {i} lives in town {i % 7} and likes colour {i % 5}" for i in range(100)]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=500)


def tiny_cfg(**changes) -> RetrieverConfig:
    return RetrieverConfig(model="tiny", tiny=TINY, **changes)


def test_format_passage():
    assert format_passage({"title": "T", "text": "body"}) == "title: T | body"
    assert format_passage({"title": "", "text": "body"}) == "body"
    assert format_passage("raw") == "raw"


def test_tiny_encodes_normalised_with_gradients(tokenizer):
    model = DualEncoder.from_config(tiny_cfg(projection_dim=16), tokenizer)
    queries, passages = model.encode_queries(QUESTIONS), model.encode_passages(PASSAGES)
    assert queries.shape == (2, 16) and passages.shape == (3, 16) and model.dim == 16
    torch.testing.assert_close(queries.norm(dim=-1), torch.ones(2))
    torch.testing.assert_close(passages.norm(dim=-1), torch.ones(3))
    (queries @ passages.T).sum().backward()
    for tower in (model.query_encoder, model.passage_encoder):
        grads = [p.grad for p in tower.parameters()]
        assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_pooling_and_normalize_follow_config(tokenizer):
    model = DualEncoder.from_config(tiny_cfg(pooling="cls", normalize=False), tokenizer)
    vectors = model.encode_passages(PASSAGES)
    assert vectors.shape == (3, TINY.d_model)
    assert not torch.allclose(vectors.norm(dim=-1), torch.ones(3))
    # cls pooling = the first token's hidden state of the underlying T5 encoder
    transformer = model.passage_encoder[0]
    features = model.passage_encoder.preprocess([format_passage(PASSAGES[0])], max_length=128)
    hidden = transformer.auto_model(input_ids=features["input_ids"], attention_mask=features["attention_mask"])
    torch.testing.assert_close(vectors[0], hidden.last_hidden_state[0, 0])


def test_seeded_and_deterministic_fingerprint(tokenizer):
    a = DualEncoder.from_config(tiny_cfg(), tokenizer, seed=3)
    b = DualEncoder.from_config(tiny_cfg(), tokenizer, seed=3)
    c = DualEncoder.from_config(tiny_cfg(), tokenizer, seed=4)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    with torch.no_grad():
        next(b.query_encoder.parameters()).add_(1e-3)
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint("passage") == b.fingerprint("passage")


def test_shared_vs_separate_towers(tokenizer):
    shared = DualEncoder.from_config(tiny_cfg(shared_towers=True), tokenizer)
    separate = DualEncoder.from_config(tiny_cfg(), tokenizer)
    assert shared.shared_towers and shared.query_encoder is shared.passage_encoder
    assert not separate.shared_towers
    n_shared = sum(p.numel() for p in shared.parameters())
    assert sum(p.numel() for p in separate.parameters()) == 2 * n_shared
    # separate towers start as copies of one initialisation (like GTR f and g from one checkpoint)
    assert separate.fingerprint("query") == separate.fingerprint("passage") == shared.fingerprint("query")
    torch.testing.assert_close(separate.encode_queries(["short text"]), separate.encode_passages(["short text"]))
    # training only the query loss moves only the query tower when towers are separate
    optimizer = torch.optim.SGD(separate.parameters(), lr=0.5)
    separate.encode_queries(QUESTIONS).sum().backward()
    optimizer.step()
    assert separate.fingerprint("query") != separate.fingerprint("passage") == shared.fingerprint("passage")


def test_frozen_passage_encoder(tokenizer):
    model = DualEncoder.from_config(tiny_cfg(train_passage_encoder=False), tokenizer)
    assert model.encode_queries(QUESTIONS).requires_grad
    assert not model.encode_passages(PASSAGES).requires_grad
    assert not any(p.requires_grad for p in model.passage_encoder.parameters())


@pytest.mark.parametrize("shared", [False, True])
def test_save_load_round_trip(tokenizer, tmp_path, shared):
    model = DualEncoder.from_config(tiny_cfg(shared_towers=shared, projection_dim=8, max_query_length=9), tokenizer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # move off the init so the test sees trained weights
    (model.encode_queries(QUESTIONS) @ model.encode_passages(PASSAGES).T).sum().backward()
    optimizer.step()
    model.eval()
    model.save(tmp_path / "retriever")
    model.save(tmp_path / "retriever")  # overwriting an existing save works
    loaded = DualEncoder.load(tmp_path / "retriever").eval()
    assert loaded.shared_towers == shared and loaded.max_query_length == 9 and loaded.dim == 8
    assert loaded.fingerprint() == model.fingerprint()
    with torch.no_grad():
        assert torch.equal(loaded.encode_queries(QUESTIONS), model.encode_queries(QUESTIONS))
        assert torch.equal(loaded.encode_passages(PASSAGES), model.encode_passages(PASSAGES))
    expected = {"shared"} if shared else {"query", "passage"}
    assert {p.name for p in (tmp_path / "retriever").iterdir() if p.is_dir()} == expected


def test_config_can_name_a_saved_retriever(tokenizer, tmp_path):
    """retriever.model=<run>/retriever continues from a trained model (the retrieval-pretrained init)."""
    model = DualEncoder.from_config(tiny_cfg(projection_dim=8), tokenizer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (model.encode_queries(QUESTIONS) @ model.encode_passages(PASSAGES).T).sum().backward()
    optimizer.step()
    model.save(tmp_path / "retriever")
    loaded = DualEncoder.from_config(RetrieverConfig(model=str(tmp_path / "retriever"), max_query_length=7,
                                                     train_passage_encoder=False))
    assert loaded.fingerprint() == model.fingerprint() and not loaded.shared_towers
    assert loaded.max_query_length == 7 and not any(p.requires_grad for p in loaded.passage_encoder.parameters())
    with pytest.raises(ConfigError, match="shared_towers=false"):
        DualEncoder.from_config(RetrieverConfig(model=str(tmp_path / "retriever"), shared_towers=True))
    with pytest.raises(ConfigError, match="tokenizer"):
        DualEncoder.from_config(RetrieverConfig(model=str(tmp_path / "retriever"), tokenizer="x"))


def _tiny_t5_folder(tokenizer, folder):
    from transformers import T5EncoderModel

    from rag_train.models.tiny import tiny_t5_config

    torch.manual_seed(0)
    T5EncoderModel(tiny_t5_config(tokenizer, TINY)).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def test_gtr_style_sentence_transformers_folder(tokenizer, tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    transformer = modules.Transformer(str(_tiny_t5_folder(tokenizer, tmp_path / "t5")))
    dense = modules.Dense(TINY.d_model, TINY.d_model, bias=False, activation_function=nn.Identity())
    gtr = SentenceTransformer(modules=[transformer, modules.Pooling(TINY.d_model, "mean"), dense, modules.Normalize()],
                              device="cpu")
    gtr.save(str(tmp_path / "gtr"))
    model = DualEncoder.from_config(RetrieverConfig(model=str(tmp_path / "gtr"), max_passage_length=512)).eval()
    assert [type(m).__name__ for m in model.passage_encoder] == ["Transformer", "Pooling", "Dense", "Normalize"]
    texts = [format_passage(p) for p in PASSAGES]
    reference = torch.as_tensor(gtr.encode(texts, convert_to_numpy=True))
    with torch.no_grad():
        torch.testing.assert_close(model.encode_passages(PASSAGES), reference, atol=1e-5, rtol=1e-5)


def test_plain_hf_encoder_folder_gets_pooling_and_projection(tokenizer, tmp_path):
    folder = _tiny_t5_folder(tokenizer, tmp_path / "t5")
    model = DualEncoder.from_config(RetrieverConfig(model=str(folder), projection_dim=12, shared_towers=True))
    assert [type(m).__name__ for m in model.query_encoder] == ["Transformer", "Pooling", "Dense", "Normalize"]
    assert model.encode_queries(QUESTIONS).shape == (2, 12)


def test_offline_hub_name_fails_fast_with_clear_message(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"sentence-transformers/gtr-t5-base.*retriever\.model=DIR"):
        DualEncoder.from_config(RetrieverConfig(model="sentence-transformers/gtr-t5-base"))


def test_tiny_without_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError, match="tokenizer"):
        DualEncoder.from_config(tiny_cfg())


def test_cpu_towers_run_eager_attention_built_or_loaded(tokenizer, tmp_path):
    """Both towers of a built and of a loaded retriever run T5's eager attention on CPU (models/attention.py) and
    embed as the same weights do under transformers' SDPA."""
    model = DualEncoder.from_config(RetrieverConfig(model="tiny", tiny=TINY), tokenizer=tokenizer).eval()
    model.save(tmp_path / "r")
    for built in (model, DualEncoder.load(tmp_path / "r")):
        assert {config._attn_implementation for config in t5_configs(built)} == {"eager"}
    passages = [{"title": "Gorar Vegapo", "text": "Gorar was born in Dapodale."}, "a much longer passage " * 6]
    with torch.no_grad():
        eager = model.encode_passages(passages)
        sdpa = set_t5_attention(model, "sdpa").encode_passages(passages)
    torch.testing.assert_close(eager, sdpa, rtol=0, atol=1e-5)


def test_a_cpu_run_on_a_gpu_machine_runs_eager_attention(tokenizer, monkeypatch):
    """Where torch sees CUDA, the towers keep transformers' SDPA unless accelerate was told to run on the CPU
    (`accelerate launch --cpu`, every run reproduce.py launches): such a run is a CPU run and gets eager, as on a
    machine without a GPU (the fourth GPU session's reproduce.py runs got SDPA on the GPU host's CPUs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = RetrieverConfig(model="tiny", tiny=TINY)
    for env, kernel in ((None, "sdpa"), ("false", "sdpa"), ("true", "eager"), ("1", "eager")):
        if env is None:
            monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
        else:
            monkeypatch.setenv("ACCELERATE_USE_CPU", env)
        model = DualEncoder.from_config(cfg, tokenizer=tokenizer)
        assert {config._attn_implementation for config in t5_configs(model)} == {kernel}, env

"""The one passage-embedding path (buffer.embed.embed_rows) against the path it replaced: sentence-transformers'
own tokenisation (`preprocess`) + forward (`DualEncoder.encode_passages`) and `SentenceTransformer.encode`,
for a T5 tower (the toy's trained tokenizer) and a BERT tower (WordPiece, [CLS]/[SEP], token type ids)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rag_train.buffer.embed import (
    CHUNK_BATCHES,
    WORKER_MIN_BATCHES,
    PassageTokenizer,
    chunk_batches,
    embed_rows,
    passage_loader,
    plan_batches,
)
from rag_train.config import RetrieverConfig, TinyModelConfig
from rag_train.data.corpus import Corpus
from rag_train.models.attention import set_t5_attention, t5_attention, t5_configs
from rag_train.models.retriever import DualEncoder, format_passage

TINY = TinyModelConfig(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2)
WORDS = "alpha beta gamma delta river stone tower city founded painted green blue north old Zürich naïve".split()
ROWS, MAX_LENGTH = 60, 24


def write_corpus(path, rows: int = ROWS) -> Corpus:
    """Passages of 1 to 40 words (many longer than MAX_LENGTH tokens: truncation), some without a title."""
    rng = np.random.default_rng(0)
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(rows):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 40))))
            handle.write(json.dumps({"id": f"p{i}", "title": f"Entity {i}" if i % 3 else "", "text": text}) + "\n")
    return Corpus.open(path)


@pytest.fixture(scope="module")
def t5_world(tmp_path_factory, toy_world):
    corpus = write_corpus(tmp_path_factory.mktemp("embed") / "passages.jsonl")
    cfg = RetrieverConfig(model="tiny", tiny=TINY, projection_dim=16, max_passage_length=MAX_LENGTH)
    return corpus, DualEncoder.from_config(cfg, str(toy_world["tokenizer"])).eval()


@pytest.fixture(scope="module")
def bert_world(tmp_path_factory):
    """A random tiny BERT with a WordPiece tokenizer (lower-casing, accents stripped), as an ST folder would hold."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    root = tmp_path_factory.mktemp("bert")
    pieces = sorted({w.lower() for w in WORDS} | {"entity", "title", ":", "|", "zurich", "naive", "##s"})
    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + pieces
             + [str(d) for d in range(10)] + [f"##{d}" for d in range(10)])
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    BertTokenizerFast(vocab_file=str(root / "vocab.txt"), do_lower_case=True).save_pretrained(root / "model")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(root / "model")
    corpus = write_corpus(root / "passages.jsonl")
    cfg = RetrieverConfig(model=str(root / "model"), pooling="mean", shared_towers=True, max_passage_length=MAX_LENGTH)
    return corpus, DualEncoder.from_config(cfg).eval()


def texts_of(corpus: Corpus) -> list[str]:
    return [format_passage(p) for p in corpus.passages(range(len(corpus)))]


@pytest.mark.parametrize("world", ["t5_world", "bert_world"])
def test_token_ids_equal_sentence_transformers(world, request):
    corpus, model = request.getfixturevalue(world)
    texts = texts_of(corpus)
    tokenizer = PassageTokenizer.for_passages(model)
    ids, lengths = tokenizer.encode(texts)
    ours = tokenizer.features(ids, lengths)
    theirs = model.passage_encoder.preprocess(texts, max_length=MAX_LENGTH)
    assert lengths.max() == MAX_LENGTH and lengths.min() < MAX_LENGTH  # some truncated, some padded
    assert set(ours) == {k for k in theirs if k != "modality"}  # token_type_ids exactly where ST gives them
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize("world", ["t5_world", "bert_world"])
def test_vectors_equal_the_replaced_path_in_float64(world, request):
    """In float64 both paths compute the same numbers up to summation order (batches differ), so the fp32
    results agree to within one fp32 rounding step."""
    corpus, model = request.getfixturevalue(world)
    model = model.double()
    try:
        ours = embed_rows(model, corpus, np.arange(len(corpus)), 8, torch.device("cpu"), batch_tokens=100)
        with torch.inference_mode():
            reference = torch.cat([model.encode_passages(corpus.passages(range(s, min(s + 16, len(corpus)))))
                                   for s in range(0, len(corpus), 16)])
    finally:
        model.float()
    assert reference.dtype == torch.float64
    torch.testing.assert_close(ours, reference.float(), atol=1e-7, rtol=0)


def test_vectors_equal_sentence_transformers_encode(bert_world):
    """fp32 against the library's own encode (its batching, sorting and normalisation): 1e-6."""
    corpus, model = bert_world
    model.passage_encoder.max_seq_length = MAX_LENGTH  # encode truncates at the tower's own limit
    theirs = model.passage_encoder.encode(texts_of(corpus), batch_size=7, convert_to_tensor=True)
    ours = embed_rows(model, corpus, np.arange(len(corpus)), 16, torch.device("cpu"))
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_workers_and_row_order(t5_world):
    """Worker processes give the bytes the main process gives; vectors follow the order of `rows` (repeats
    included); the global RNG is untouched (the DataLoader draws from its own generator)."""
    corpus, model = t5_world
    rows = np.random.default_rng(1).integers(0, len(corpus), size=WORKER_MIN_BATCHES * 4 + 10)  # unsorted, repeats
    state = torch.get_rng_state()
    in_process = embed_rows(model, corpus, rows, 4, torch.device("cpu"), num_workers=0)
    in_workers = embed_rows(model, corpus, rows, 4, torch.device("cpu"), num_workers=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(in_process, in_workers)
    each = embed_rows(model, corpus, np.arange(len(corpus)), 4, torch.device("cpu"))
    torch.testing.assert_close(in_process, each[torch.from_numpy(rows)], atol=1e-6, rtol=0)  # other batches


def test_small_passes_run_in_the_main_process(t5_world):
    """Below WORKER_MIN_BATCHES batches no worker starts, whatever num_workers says; at it, the workers asked for."""
    corpus, model = t5_world
    tokenizer = PassageTokenizer.for_passages(model)

    def workers(rows: int) -> int:
        return passage_loader(corpus, np.arange(rows) % len(corpus), tokenizer, 4, 4 * tokenizer.max_length, 2,
                              pin_memory=False).num_workers

    assert (workers(4 * WORKER_MIN_BATCHES - 1), workers(4 * WORKER_MIN_BATCHES)) == (0, 2)


def test_corpus_passes_run_eager_attention_and_restore_the_kernel(t5_world, monkeypatch):
    """A tower on SDPA (as on CUDA) embeds through eager attention, the same vectors, and is on SDPA again after."""
    corpus, model = t5_world
    kernels_seen = []
    forward = model.encode_passage_features

    def spy(features):
        kernels_seen.append({config._attn_implementation for config in t5_configs(model)})
        return forward(features)

    set_t5_attention(model, "sdpa")
    try:
        with torch.inference_mode():
            on_sdpa = model.encode_passages(corpus.passages(range(len(corpus))))
        monkeypatch.setattr(model, "encode_passage_features", spy)
        ours = embed_rows(model, corpus, np.arange(len(corpus)), 16, torch.device("cpu"))
        after = {config._attn_implementation for config in t5_configs(model)}
    finally:
        set_t5_attention(model, "eager")
    assert kernels_seen and all(seen == {"eager"} for seen in kernels_seen)
    assert after == {"sdpa"}
    torch.testing.assert_close(ours, on_sdpa, atol=1e-6, rtol=0)


def test_t5_attention_restores_each_kernel_after_an_error(t5_world):
    _, model = t5_world
    configs = t5_configs(model)
    configs[0]._attn_implementation = "sdpa"  # mixed kernels come back as they were, one by one
    before = [config._attn_implementation for config in configs]
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with t5_attention(model, "eager"):
                assert {config._attn_implementation for config in configs} == {"eager"}
                raise RuntimeError("inside")
        assert [config._attn_implementation for config in configs] == before
    finally:
        set_t5_attention(model, "eager")


def test_chunk_batches_give_every_worker_two_items_by_hand():
    assert CHUNK_BATCHES == 8
    assert chunk_batches(28_000_000, 1024, 8) == 8  # a big corpus: whole 8-batch items
    assert chunk_batches(65_536, 1024, 8) == 4  # 16 items of 4 batches for 8 workers
    assert chunk_batches(4_096, 1024, 8) == 1  # 4 one-batch items, not one item that 7 workers wait beside
    assert chunk_batches(138, 4, 2) == 8  # ceil(138 / (4 x 2 x 2)) = 9, capped: the worker test above, 5 items
    assert chunk_batches(10, 4, 0) == 8  # in process: items only amortise the tokeniser call


def test_plan_batches_by_hand():
    lengths = np.array([5, 1, 5, 3, 2])
    # sorted 1, 2, 3, 5, 5: three rows (cap) of width 3 = 9 tokens fit; two of width 5 = 10 do not
    assert [b.tolist() for b in plan_batches(lengths, 3, 9)] == [[1, 4, 3], [0], [2]]
    assert [b.tolist() for b in plan_batches(np.array([12, 2]), 8, 10)] == [[1], [0]]  # too long: alone

"""FiD reader and its collator, checked against plain T5 run the straightforward way."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutput

from rag_train.config import ReaderConfig, TinyModelConfig
from rag_train.data.collate import answer_labels, choose_answer, fid_inputs, format_fid_input
from rag_train.models.attention import t5_configs
from rag_train.models.reader import FiDReader, ReaderLoadError

VOCAB = 100


def tiny_config(dropout: float = 0.0) -> T5Config:
    return T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=dropout, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )


@pytest.fixture
def reader() -> FiDReader:
    torch.manual_seed(0)
    return FiDReader(tiny_config()).eval()


def plain_t5(reader: FiDReader) -> T5ForConditionalGeneration:
    """A plain HF T5 holding the reader's weights (the reference implementation)."""
    plain = T5ForConditionalGeneration(reader.config).eval()
    plain.load_state_dict(reader.state_dict())
    return plain


def checkpointing_on(model) -> bool:
    """transformers 5 renamed the flag; older releases only have the old name."""
    return getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing


def ragged_batch(seed: int = 1):
    """[B=2, P=3, L=8] inputs with right padding of different lengths, and labels with -100 padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([[8, 5, 3], [6, 8, 2]])
    ids = torch.randint(3, VOCAB, (2, 3, 8), generator=g)
    mask = (torch.arange(8) < lengths[..., None]).long()
    ids = ids * mask
    labels = torch.tensor([[17, 42, 9, 1], [23, 1, -100, -100]])
    return ids, mask, labels


def unpadded(ids, mask, b, p):
    keep = mask[b, p].bool()
    return ids[b, p][keep][None], mask[b, p][keep][None]


def test_state_dict_and_checkpoints_are_plain_t5(reader, tmp_path):
    assert list(reader.state_dict()) == list(T5ForConditionalGeneration(reader.config).state_dict())
    reader.save_pretrained(tmp_path / "r")
    plain = T5ForConditionalGeneration.from_pretrained(tmp_path / "r")
    for key, value in reader.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key]), key
    plain.save_pretrained(tmp_path / "p")
    again = FiDReader.from_config(ReaderConfig(model=str(tmp_path / "p")))
    assert isinstance(again, FiDReader)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key


def test_single_passage_fid_equals_plain_t5(reader):
    ids, mask, labels = ragged_batch()
    ids, mask = ids[:, 1:2], mask[:, 1:2]  # P = 1, still padded
    fid = reader(ids, mask, labels=labels)
    ref = plain_t5(reader)(input_ids=ids[:, 0], attention_mask=mask[:, 0], labels=labels)
    torch.testing.assert_close(fid.loss, ref.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(fid.logits, ref.logits, rtol=0, atol=1e-5)


def test_fid_decoder_attends_to_concatenated_unpadded_passages(reader):
    ids, mask, labels = ragged_batch()
    fid = reader(ids, mask, labels=labels)
    plain = plain_t5(reader)
    for b in range(2):
        states = [plain.encoder(*unpadded(ids, mask, b, p)).last_hidden_state for p in range(3)]
        memory = torch.cat(states, dim=1)  # only real tokens, no mask needed
        ref = plain(encoder_outputs=BaseModelOutput(last_hidden_state=memory), labels=labels[b : b + 1])
        torch.testing.assert_close(fid.logits[b : b + 1], ref.logits, rtol=0, atol=1e-5)
    assert fid.encoder_last_hidden_state.shape == (2, 3 * 8, 32)


def test_passage_log_likelihoods_equal_per_passage_t5(reader):
    ids, mask, labels = ragged_batch()
    plain = plain_t5(reader)
    expected = torch.zeros(2, 3)
    for b in range(2):
        answer = labels[b : b + 1]
        for p in range(3):
            logits = plain(*unpadded(ids, mask, b, p), labels=answer).logits[0]
            keep = answer[0] != -100
            expected[b, p] = logits.log_softmax(-1)[keep].gather(1, answer[0][keep][:, None]).sum()
    fresh = reader.passage_log_likelihoods(ids, mask, labels)
    torch.testing.assert_close(fresh, expected, rtol=0, atol=1e-5)
    with torch.no_grad():
        states = reader(ids, mask, labels=labels).encoder_last_hidden_state
        reused = reader.passage_log_likelihoods(ids, mask, labels, encoder_states=states)
    torch.testing.assert_close(reused, expected, rtol=0, atol=1e-5)
    assert reused.dtype == torch.float32 and not reused.requires_grad


def test_generate_matches_greedy_loop_and_learns_an_answer():
    torch.manual_seed(0)
    reader = FiDReader(tiny_config())
    ids, mask, _ = ragged_batch()
    labels = torch.tensor([[17, 42, 9, 1], [23, 55, 1, -100]])
    optimizer = torch.optim.Adam(reader.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = reader(ids, mask, labels=labels).loss
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05 * first
    reader.eval()
    generated = reader.generate(ids, mask, max_new_tokens=6, do_sample=False, num_beams=1)
    assert generated[0, 1:5].tolist() == [17, 42, 9, 1]
    assert generated[1, 1:4].tolist() == [23, 55, 1]
    # the same by hand: greedy argmax over FiD forward passes, pad after eos
    sequence = torch.zeros(2, 1, dtype=torch.long)
    done = torch.zeros(2, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(generated.shape[1] - 1):
            nxt = reader(ids, mask, decoder_input_ids=sequence).logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.zeros_like(nxt), nxt)
            done |= nxt == 1
            sequence = torch.cat([sequence, nxt[:, None]], dim=1)
    assert torch.equal(generated, sequence)


def test_activation_checkpointing_gives_same_loss_and_gradients():
    ids, mask, labels = ragged_batch()
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        reader = FiDReader(tiny_config()).train()
        if checkpointing:
            reader.enable_activation_checkpointing()
            assert checkpointing_on(reader)
        loss = reader(ids, mask, labels=labels).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in reader.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grad, grads[1][1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_reader_runs_close_to_fp32(reader):
    ids, mask, labels = ragged_batch()
    half = FiDReader(reader.config).eval()
    half.load_state_dict(reader.state_dict())
    half = half.to(torch.bfloat16)
    assert half.dtype == torch.bfloat16
    loss32 = reader(ids, mask, labels=labels).loss
    loss16 = half(ids, mask, labels=labels).loss
    assert torch.isfinite(loss16) and abs(loss16.float() - loss32) < 0.05 * loss32
    ll16 = half.passage_log_likelihoods(ids, mask, labels)
    assert ll16.dtype == torch.float32
    torch.testing.assert_close(ll16, reader.passage_log_likelihoods(ids, mask, labels), rtol=0.05, atol=0.2)


def test_from_config_fails_fast_offline_with_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ReaderLoadError, match=r"reader.model='no-such-org/no-such-t5'.*local T5 folder"):
        FiDReader.from_config(ReaderConfig(model="no-such-org/no-such-t5"))
    with pytest.raises(ReaderLoadError, match="needs a tokenizer"):
        FiDReader.from_config(ReaderConfig(model="tiny"))


def test_from_config_tiny_sized_by_config_and_tokenizer():
    tok = word_tokenizer(WORDS)
    cfg = ReaderConfig(model="tiny", tiny=TinyModelConfig(d_model=16, d_ff=32, d_kv=4, num_heads=4, num_layers=1,
                                                          num_decoder_layers=2))
    model = FiDReader.from_config(cfg, tokenizer=tok, dtype=torch.bfloat16)
    assert model.config.vocab_size == len(tok) and model.config.d_model == 16
    assert (model.config.num_layers, model.config.num_decoder_layers) == (1, 2)
    assert model.dtype == torch.bfloat16 and model.config.decoder_start_token_id == tok.pad_token_id


def test_from_config_rejects_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ReaderLoadError, match="is a folder but not a T5 checkpoint"):
        FiDReader.from_config(ReaderConfig(model=str(tmp_path)))


def test_from_config_rejects_tokenizer_larger_than_vocab(reader, tmp_path):
    reader.save_pretrained(tmp_path)
    big = word_tokenizer([f"w{i}" for i in range(VOCAB + 5)])
    with pytest.raises(ReaderLoadError, match="token embeddings"):
        FiDReader.from_config(ReaderConfig(model=str(tmp_path)), tokenizer=big)
    loaded = FiDReader.from_config(ReaderConfig(model=str(tmp_path), gradient_checkpointing=True))
    assert checkpointing_on(loaded)


def test_bad_shapes_are_rejected(reader):
    ids, mask, labels = ragged_batch()
    with pytest.raises(ValueError, match="attention_mask shape"):
        reader(ids, mask[:, 0], labels=labels)
    with pytest.raises(ValueError, match="labels must be"):
        reader.passage_log_likelihoods(ids, mask, labels[:1])


# --------------------------------------------------------------------------------------------------
# Collate
# --------------------------------------------------------------------------------------------------


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """T5-style ids (pad 0, eos 1, unk 2) over whitespace-separated words."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


WORDS = "question: title: context: who wrote it ada bob wrote the book a b c d e f g paris london".split()


def decode(tokenizer, ids) -> str:
    return tokenizer.decode([i for i in ids if i != 0])


def test_fid_inputs_format_truncate_pad():
    tok = word_tokenizer(WORDS)
    passages = [
        [{"title": "ada", "text": "ada wrote the book"}, {"title": "bob", "text": "a b c d e f g"}],
        [{"title": "paris", "text": "london"}, "a b"],
    ]
    batch = fid_inputs(tok, ["who wrote it", "who"], passages, max_length=12)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape == (2, 2, 12)
    assert decode(tok, ids[0, 0]) == "question: who wrote it title: ada context: ada wrote the book </s>"
    # truncated to 11 tokens + eos
    assert decode(tok, ids[0, 1]) == "question: who wrote it title: bob context: a b c d </s>"
    assert decode(tok, ids[1, 1]) == "question: who context: a b </s>"
    lengths = mask.sum(-1)
    assert lengths.tolist() == [[12, 12], [7, 6]]
    assert (ids[mask == 0] == 0).all() and (ids[mask == 1] != 0).all()
    assert format_fid_input("q", {"title": "t", "text": "x"}) == "question: q title: t context: x"
    with pytest.raises(ValueError, match="question 1 has 1 passages"):
        fid_inputs(tok, ["who", "who"], [["a", "b"], ["a"]], max_length=8)


def test_answer_labels_eos_and_ignore_padding():
    tok = word_tokenizer(WORDS)
    labels = answer_labels(tok, [["paris", "london"], "a b c d e"], max_length=4)
    assert labels.tolist() == [
        [tok.convert_tokens_to_ids("paris"), 1, -100, -100],
        [tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b"), tok.convert_tokens_to_ids("c"), 1],
    ]
    with pytest.raises(ValueError, match="no answers"):
        answer_labels(tok, [[]], max_length=4)


def test_choose_answer_first_or_seeded_random():
    answers = ["a", "b", "c"]
    assert choose_answer(answers) == "a"
    draws = [choose_answer(answers, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) == set(answers)
    again = [choose_answer(answers, torch.Generator().manual_seed(s)) for s in range(40)]
    assert draws == again


def test_collated_batch_trains_reader():
    tok = word_tokenizer(WORDS)
    torch.manual_seed(0)
    reader = FiDReader(tiny_config())
    batch = fid_inputs(tok, ["who wrote it"], [[{"title": "ada", "text": "ada wrote"}, "bob"]], max_length=16)
    labels = answer_labels(tok, [["ada"]], max_length=4)
    out = reader(batch["input_ids"], batch["attention_mask"], labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.loss) and reader.shared.weight.grad.abs().sum() > 0


def test_a_t5_v1_1_checkpoint_keeps_its_own_output_layer_and_unscaled_logits(tmp_path):
    """google/t5-base-lm-adapt is T5 v1.1: a separate lm_head and no d_model**-0.5 scaling of the decoder output,
    flagged by `tie_word_embeddings: false` in its config.json. transformers 5 forces the config's flag to True
    and keeps v1.1 in `scale_decoder_outputs`: a hub-style folder must still load as v1.1 through reader.model."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import T5Config

    from rag_train.config import ReaderConfig

    config = T5Config(vocab_size=64, d_model=16, d_ff=32, d_kv=4, num_heads=4, num_layers=1,
                      feed_forward_proj="gated-gelu", decoder_start_token_id=0)
    FiDReader(config).save_pretrained(tmp_path)
    weights = dict(load_file(str(tmp_path / "model.safetensors")))
    weights["lm_head.weight"] = torch.randn(64, 16)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hub_style = json.loads((tmp_path / "config.json").read_text())
    hub_style.pop("scale_decoder_outputs", None)  # not a key of the hub's v1.1 configs
    hub_style["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(hub_style))

    reader = FiDReader.from_config(ReaderConfig(model=str(tmp_path))).eval()
    assert torch.equal(reader.lm_head.weight, weights["lm_head.weight"])
    assert not torch.equal(reader.lm_head.weight, reader.shared.weight)
    ids = torch.tensor([[5, 6, 7, 1]])
    labels = torch.tensor([[8, 9, 1]])
    with torch.no_grad():
        out = reader(input_ids=ids, labels=labels, output_hidden_states=True)
        unscaled = out.decoder_hidden_states[-1] @ weights["lm_head.weight"].T
    torch.testing.assert_close(out.logits, unscaled)


def attention_kernels(model) -> set:
    return {config._attn_implementation for config in t5_configs(model)}


def test_a_cpu_reader_runs_eager_attention_and_computes_what_sdpa_computes(reader, tmp_path):
    """On CPU every reader, built or loaded, runs T5's eager attention (faster there, models/attention.py); its loss,
    logits and gradients on padded FiD inputs are those of the same weights under transformers' SDPA."""
    assert attention_kernels(reader) == {"eager"}
    reader.save_pretrained(tmp_path / "r")
    assert attention_kernels(FiDReader.from_pretrained(tmp_path / "r")) == {"eager"}
    reference = T5ForConditionalGeneration(tiny_config()).eval()
    reference.load_state_dict(reader.state_dict())
    assert attention_kernels(reference) == {"sdpa"}  # transformers' own default: the independent reference
    ids, mask, labels = ragged_batch()
    fid = reader(ids, mask, labels=labels)
    fid.loss.backward()
    states = reader.encode_pairs(ids, mask).reshape(2, 3 * 8, -1)
    ref = reference(encoder_outputs=BaseModelOutput(last_hidden_state=reference.encoder(
        input_ids=ids.reshape(6, 8), attention_mask=mask.reshape(6, 8)).last_hidden_state.reshape(2, 24, -1)),
        attention_mask=mask.reshape(2, 24), labels=labels)
    ref.loss.backward()
    torch.testing.assert_close(states, fid.encoder_last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(fid.logits, ref.logits, rtol=0, atol=1e-5)
    for (name, mine), theirs in zip(reader.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6, msg=name)


def overwrite_middle(path, size: int = 4096) -> None:
    """4 KiB of zeros in the middle of a file: same size, other bytes (a bad sector, a torn copy)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + size] = bytes(size)
    path.write_bytes(bytes(data))


def test_a_saved_reader_carries_checksums_that_every_loader_checks(reader, tmp_path):
    from rag_train.generative.model import load_generator
    from rag_train.io import CorruptFileError
    from rag_train.train.run import save_pretrained_atomic

    folder = tmp_path / "reader"
    save_pretrained_atomic(folder, reader)
    assert FiDReader.from_config(ReaderConfig(model=str(folder))).config.d_model == 32  # intact: loads
    overwrite_middle(folder / "model.safetensors")
    for load in (lambda: FiDReader.from_config(ReaderConfig(model=str(folder))),
                 lambda: load_generator(str(folder), None)):
        with pytest.raises(CorruptFileError, match=f"{folder / 'model.safetensors'}: sha256 does not match "
                                                   f"{folder / 'checksums.json'}"):
            load()


def test_evaluate_names_a_damaged_final_reader(reader, tmp_path, zygote):
    """scripts/evaluate.py on a run whose reader/model.safetensors lost 4 KiB: exit 2 and one line naming the
    file, before any work (it used to answer every question with an empty string and exit 0)."""
    from pathlib import Path

    from rag_train.config import save_config
    from rag_train.train.run import save_pretrained_atomic
    from rag_train.train.schema import RLMConfig

    run = tmp_path / "run"
    save_pretrained_atomic(run / "reader", reader)
    (run / "retriever").mkdir()
    save_config(RLMConfig(), run / "config.yaml")
    overwrite_middle(run / "reader" / "model.safetensors")
    root = Path(__file__).resolve().parents[1]
    answer = zygote.run({"argv": ["scripts/evaluate.py", "--run", str(run)], "cwd": str(root), "env": {},
                         "stdout": str(tmp_path / "out"), "stderr": str(tmp_path / "err")})
    stderr = (tmp_path / "err").read_text()
    assert answer["status"] == 2 and "Traceback" not in stderr, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == (f"error: {run / 'reader' / 'model.safetensors'}: sha256 does not "
                                               f"match {run / 'reader' / 'checksums.json'} (the file is corrupt or "
                                               "was replaced)")

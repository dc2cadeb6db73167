"""Tied weights through a real checkpoint (`TrainingRun.save` / `resume`) and the saved reader folder: one copy of
T5's shared embedding on disk, no "Removed shared tensor" line, and a reloaded reader that still ties its
embeddings and gives the logits it gave before saving."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import T5Config

from rag_train.config import load_config
from rag_train.models.reader import FiDReader
from rag_train.train.run import TrainingRun, save_pretrained_atomic
from rag_train.train.schema import RLMConfig
from rag_train.train.step import linear_warmup
from rag_train.train.trainable import Trainable

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "toy" / "rlm.yaml"
ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")


def reader(seed: int) -> FiDReader:
    torch.manual_seed(seed)
    config = T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                      dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return FiDReader(config).eval()


def run_and_model(out: Path, seed: int, resume: bool) -> tuple[TrainingRun, torch.nn.Module, torch.optim.Optimizer]:
    cfg = load_config(RLMConfig, CONFIG, [f"train.output_dir={out}", "train.tracker=null",
                                          f"train.resume={str(resume).lower()}"])
    run = TrainingRun(cfg, "ties")
    model = Trainable(reader=reader(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    prepared, optimizer, _ = run.prepare(model, optimizer, linear_warmup(optimizer, 1))
    return run, prepared, optimizer


def logits(model: FiDReader) -> torch.Tensor:
    ids = torch.tensor([[5, 9, 13, 2, 1], [7, 3, 1, 0, 0]])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids > 0).long(),
                     decoder_input_ids=torch.tensor([[0, 4], [0, 8]])).logits


def assert_tied(model: FiDReader) -> None:
    """The aliases share the embedding's memory, and a change to the embedding shows in all of them."""
    pointer = model.shared.weight.data_ptr()
    assert all(model.get_parameter(name).data_ptr() == pointer for name in ALIASES)
    with torch.no_grad():
        row = model.shared.weight[3].clone()
        model.shared.weight[3] = 7.0
        changed = [bool((model.get_parameter(name)[3] == 7.0).all()) for name in ALIASES]
        model.shared.weight[3] = row
    assert all(changed)


def test_a_checkpoint_stores_tied_weights_once_silently_and_reloads_them_tied(tmp_path, caplog, capfd):
    run, prepared, optimizer = run_and_model(tmp_path / "run", seed=0, resume=False)
    trained = run.accelerator.unwrap_model(prepared).reader
    ids = torch.tensor([[5, 9, 13, 2, 1]])
    loss = trained(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([[4, 1]])).loss
    loss.backward()  # one step, so the saved weights are not the init a fresh model of this seed has
    optimizer.step()
    before = logits(trained)
    with caplog.at_level(logging.INFO):
        folder = run.save(1)
        save_pretrained_atomic(tmp_path / "reader", trained)
    assert "Removed shared tensor" not in caplog.text + capfd.readouterr().err
    stored = load_file(str(folder / "model.safetensors"))
    assert "reader.shared.weight" in stored and not any(f"reader.{name}" in stored for name in ALIASES)
    assert torch.equal(stored["reader.shared.weight"], trained.shared.weight)

    run, prepared, _ = run_and_model(tmp_path / "run", seed=1, resume=True)  # another init, then the checkpoint
    resumed = run.accelerator.unwrap_model(prepared).reader
    assert not torch.equal(logits(resumed), before)
    assert run.resume() == 1
    assert_tied(resumed)
    assert torch.equal(logits(resumed), before)

    again = FiDReader.from_pretrained(tmp_path / "reader").eval()  # the run's reader/ folder (save_pretrained)
    assert_tied(again)
    assert torch.equal(logits(again), before)

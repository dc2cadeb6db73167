"""rag_lab/bench/rlm_step.py (the base-size RLM step benchmark) at a tiny shape on CPU: it runs, times the
recipe's own `RLMRecipe.train_step`, reports every field, and its own check (encoder-reuse likelihoods ==
re-encoding == plain T5 per passage) holds, and fails when the reuse path is broken."""

from __future__ import annotations

import json

import pytest
import torch

from rag_lab.bench import rlm_step as bench
from rag_train.models.reader import FiDReader
from rag_train.train.rlm import RLMRecipe

TINY = ["--size", "tiny", "--device", "cpu", "--batch", "2", "--passages", "3", "--passage-length", "12",
        "--question-length", "5", "--answer-length", "4", "--steps", "1", "--warmup", "1", "--threads", "1",
        "--corpus-rows", "64", "--corrector-hidden", "32", "--candidates", "5"]


@pytest.fixture
def restore_threads():
    """Also a fresh accelerate state (one mixed precision per process) before and after: the benchmark, like a
    user's run, sets train.mixed_precision, and the tests in this process run with `no`."""
    from accelerate.state import AcceleratorState

    threads = torch.get_num_threads()
    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiny_step_reports_every_number_and_reuse_matches_reencoding(tmp_path, restore_threads, dtype, capsys,
                                                                    monkeypatch):
    calls = []
    train_step = RLMRecipe.train_step

    def recorded(self, examples, step):  # the timed step is the recipe's own, whole
        calls.append((len(examples), step, self.accelerator.mixed_precision))
        return train_step(self, examples, step)

    monkeypatch.setattr(RLMRecipe, "train_step", recorded)
    out = tmp_path / "bench.json"
    result = bench.main([*TINY, "--dtype", dtype, "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["shape"] == {"size": "tiny", "batch": 2, "passages": 3, "passage_length": 12, "question_length": 5,
                              "answer_length": 4, "corpus_rows": 64, "corrector_hidden": 32, "candidates": 5,
                              "dtype": dtype, "checkpointing": True, "steps": 1, "warmup": 1}
    assert calls == [(2, 0, "bf16" if dtype == "bf16" else "no"), (2, 1, "bf16" if dtype == "bf16" else "no")]
    assert {"reader_loss", "retriever_loss", "corrector_loss"} <= set(saved["step"]["logged"][0])
    for key in ("seconds", "median_s"):
        assert key in saved["step"]
    assert saved["step"]["median_s"] > 0 and saved["memory"]["peak_bytes"] > 0
    lk = saved["likelihoods"]
    for key in ("reuse_median_s", "reencode_median_s", "saving_s", "ratio", "saving_fraction_of_step",
                "reuse_in_step_median_s"):
        assert isinstance(lk[key], float), key
    assert lk["saving_s"] == pytest.approx(lk["reencode_median_s"] - lk["reuse_median_s"])
    check = saved["check"]
    assert check["allclose"] is True
    assert check["max_abs_diff_reuse_vs_reencode"] <= 1e-3
    assert check["max_abs_diff_reuse_vs_single_passage_t5"] <= 1e-3
    assert check["single_passage_pairs_checked"] == 4
    assert saved["parameters"]["corrector"] == 2 * 64 * 32 + 32 + 64  # h: 64 -> 32 -> 64, biases included
    assert result["check"] == check
    assert "| saving / step time |" in capsys.readouterr().out


def test_check_catches_a_broken_reuse_path(tmp_path, restore_threads, monkeypatch):
    """Encoder states fused in the wrong passage order: reuse no longer equals re-encoding, and no timings."""
    fuse = FiDReader.fuse

    def misordered(states, mask):
        batch, passages, _ = mask.shape
        states = states.view(batch, passages, *states.shape[1:]).roll(1, dims=1).reshape(states.shape)
        return fuse(states, mask)

    monkeypatch.setattr(FiDReader, "fuse", staticmethod(misordered))
    out = tmp_path / "bench.json"
    with pytest.raises(bench.BenchmarkCheckError):
        bench.main([*TINY, "--dtype", "fp32", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["check"]["allclose"] is False and "step" not in saved

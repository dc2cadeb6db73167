"""scripts/bench_rlm_step.py (the base-size RLM step benchmark) at a tiny shape on CPU: it runs, reports every
field, and its own check (encoder-reuse likelihoods == re-encoding == plain T5 per passage) holds, and fails
when the reuse path is broken."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from rag_train.models.reader import FiDReader

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--size", "tiny", "--device", "cpu", "--batch", "2", "--passages", "3", "--passage-length", "12",
        "--question-length", "5", "--answer-length", "4", "--steps", "1", "--warmup", "1", "--threads", "1"]


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_rlm_step", ROOT / "scripts" / "bench_rlm_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiny_step_reports_every_number_and_reuse_matches_reencoding(tmp_path, restore_threads, dtype, capsys):
    bench = _load_script()
    out = tmp_path / "bench.json"
    result = bench.main([*TINY, "--dtype", dtype, "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["shape"] == {"size": "tiny", "batch": 2, "passages": 3, "passage_length": 12, "question_length": 5,
                              "answer_length": 4, "dtype": dtype, "checkpointing": True, "steps": 1, "warmup": 1}
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
    assert saved["parameters"]["reader"] > 0 and saved["parameters"]["retriever"] > 0
    assert result["check"] == check
    assert "| saving / step time |" in capsys.readouterr().out


def test_check_catches_a_broken_reuse_path(tmp_path, restore_threads, monkeypatch):
    """Encoder states fused in the wrong passage order: reuse no longer equals re-encoding, and no timings."""
    bench = _load_script()
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

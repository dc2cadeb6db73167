"""scripts/bench_attention.py: the kernels it times compute the same thing, and a disagreement stops it."""

from __future__ import annotations

import pytest
import torch

from rag_lab.bench import attention as bench
from rag_train.models.attention import t5_configs


def t5_kernels(model) -> set:
    return {config._attn_implementation for config in t5_configs(model)}


def test_quick_run_times_eager_against_sdpa_on_equal_outputs(capsys):
    bench.main(["--quick", "--rounds", "1", "--threads", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| d ") or "toy reader" in line]
    assert len(rows) == 2
    for row in rows:
        assert float(row.rstrip(" |").split("|")[-1]) <= bench.TOLERANCE


def test_the_reference_is_transformers_default_with_the_same_weights():
    torch.manual_seed(0)
    config = bench.T5Config(vocab_size=50, d_model=16, d_ff=32, d_kv=4, num_heads=4, num_layers=1,
                            num_decoder_layers=1, feed_forward_proj="gated-gelu_pytorch_tanh")
    ours = bench.FiDReader(config)
    default = bench.as_transformers_default(ours, activation="gelu_new")
    assert t5_kernels(ours) == {"eager"} and t5_kernels(default) == {"sdpa"}
    assert default.config.dense_act_fn == "gelu_new" and ours.config.dense_act_fn == "gelu_pytorch_tanh"
    for (name, a), b in zip(ours.state_dict().items(), default.state_dict().values()):
        assert torch.equal(a, b), name


def test_kernels_that_disagree_stop_the_benchmark(monkeypatch):
    real = bench.as_transformers_default

    def perturbed(model, activation=None):
        other = real(model, activation)
        with torch.no_grad():
            next(other.parameters()).add_(0.5)
        return other

    monkeypatch.setattr(bench, "as_transformers_default", perturbed)
    with pytest.raises(SystemExit, match="disagree"):
        bench.main(["--quick", "--rounds", "1", "--threads", "1"])

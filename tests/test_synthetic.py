"""Synthetic corrector experiment (seed 000, Sec. 5.3): loss and metric against references, identity at
zero drift, training beats staleness, and bitwise determinism across runs and worker counts."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from rag_lab.analysis.synthetic import (
    CorrectorSpec,
    Job,
    SyntheticConfig,
    corrector_grid,
    drift_network,
    grid_jobs,
    make_corrector,
    make_data,
    mean_kl,
    parameter_count,
    quick_config,
    run_job,
    truncated_ce,
)
from rag_train.losses import corrector_ce

QUICK = quick_config()


@pytest.fixture(autouse=True)
def one_thread():
    """The experiment runs one torch thread per worker; two threads on tiny matmuls only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_truncated_ce_matches_corrector_ce_value_and_gradient():
    gen = torch.Generator().manual_seed(0)
    fresh = 3 * torch.randn(5, 40, generator=gen, dtype=torch.float64)
    corrected = (3 * torch.randn(5, 40, generator=gen, dtype=torch.float64)).requires_grad_()
    reference = corrector_ce(fresh, corrected)
    (ref_grad,) = torch.autograd.grad(reference, corrected)
    ours = truncated_ce(corrected, torch.softmax(fresh, dim=-1))
    (our_grad,) = torch.autograd.grad(ours, corrected)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(our_grad, ref_grad)


def test_mean_kl_matches_numpy():
    gen = torch.Generator().manual_seed(1)
    queries, fresh, approx = (torch.randn(n, 4, generator=gen) for n in (6, 30, 30))
    q, f, a = queries.double().numpy(), fresh.double().numpy(), approx.double().numpy()

    def log_softmax(s):
        s = s - s.max(axis=1, keepdims=True)
        return s - np.log(np.exp(s).sum(axis=1, keepdims=True))

    log_p, log_a = log_softmax(2.0 * q @ f.T), log_softmax(2.0 * q @ a.T)
    expected = (np.exp(log_p) * (log_p - log_a)).sum(axis=1).mean()
    assert mean_kl(queries, fresh, approx, beta=2.0) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("layers,width,expected_params", [(0, 0, 8 * 8 + 8), (1, 16, 8 * 16 + 16 + 16 * 8 + 8),
                                                         (2, 16, 8 * 16 + 16 + 16 * 16 + 16 + 16 * 8 + 8)])
def test_correctors_are_identity_at_init_with_expected_size(layers, width, expected_params):
    corrector = make_corrector(8, layers, width)
    stale = torch.randn(50, 8)
    assert torch.equal(corrector(stale), stale)
    assert parameter_count(corrector) == expected_params


def test_corrector_grid_covers_paper_sizes():
    labels = [spec.label for spec in corrector_grid(8)]
    assert labels == ["linear", "1x8", "1x16", "1x32", "1x64", "2x8", "2x16", "2x32", "2x64"]


def test_zero_drift_gives_zero_staleness_and_identity_keeps_it():
    data = make_data(QUICK, seed=3)
    fresh = drift_network(QUICK, seed=3, scale=0.0)(data.stale)
    assert torch.equal(fresh, data.stale)
    assert mean_kl(data.eval_queries, fresh, data.stale, QUICK.beta) == 0.0
    corrector = make_corrector(QUICK.dim, 1, 16)
    with torch.no_grad():
        assert mean_kl(data.eval_queries, fresh, corrector(data.stale), QUICK.beta) == 0.0
    # Training from the optimum never finds a lower loss, so the restored best weights stay the identity.
    result = run_job(QUICK, Job(seed=3, drift_scale=0.0, spec_index=1, spec=CorrectorSpec(1, 16), fraction=0.1))
    assert result["kl_stale"] == 0.0 and result["kl_after"] == 0.0


def test_drift_grows_with_scale():
    data = make_data(QUICK, seed=0)
    kls = [mean_kl(data.eval_queries, drift_network(QUICK, 0, s)(data.stale), data.stale, QUICK.beta)
           for s in (0.25, 0.5, 1.0)]
    assert 0 < kls[0] < kls[1] < kls[2]


def test_training_on_a_tenth_of_targets_cuts_the_kl_on_all_targets():
    result = run_job(QUICK, Job(seed=0, drift_scale=0.5, spec_index=1, spec=CorrectorSpec(1, 8), fraction=0.1))
    assert result["train_targets"] == round(0.1 * QUICK.targets)
    assert result["kl_after"] < 0.5 * result["kl_stale"]


def test_early_stopping_and_max_epochs():
    short = replace(QUICK, max_epochs=7)
    result = run_job(short, Job(seed=0, drift_scale=0.5, spec_index=0, spec=CorrectorSpec(0, 0), fraction=1.0))
    assert result["epochs"] == 7
    zero = run_job(QUICK, Job(seed=0, drift_scale=0.0, spec_index=0, spec=CorrectorSpec(0, 0), fraction=1.0))
    assert zero["epochs"] == QUICK.patience + 1  # best at epoch 1, then `patience` epochs without improvement


def test_bad_grid_and_config_are_rejected():
    with pytest.raises(ValueError, match="fraction"):
        grid_jobs([0], [0.5], corrector_grid(8), [0.0])
    with pytest.raises(ValueError, match="drift scale"):
        grid_jobs([0], [-1.0], corrector_grid(8), [0.5])
    with pytest.raises(ValueError, match="targets"):
        SyntheticConfig(targets=0)
    with pytest.raises(ValueError, match="hidden_layers"):
        make_corrector(8, 3, 8)


def test_run_job_is_deterministic():
    job = Job(seed=2, drift_scale=1.0, spec_index=6, spec=CorrectorSpec(2, 16), fraction=0.1)
    assert run_job(QUICK, job) == run_job(QUICK, job)


def test_grid_outputs_and_same_results_with_one_or_two_workers(tmp_path):
    from rag_lab.analysis import synthetic_report as script

    results = {}
    for workers in (1, 2):
        out = tmp_path / f"workers{workers}"
        script.main(["--quick", "--drift-scales", "0.5", "--fractions", "0.1", "--workers", str(workers),
                     "--out-dir", str(out)])
        results[workers] = json.loads((out / "results.json").read_text())["runs"]
    assert len(results[1]) == 3
    assert results[1] == results[2]
    for name in ("results.md", "kl_vs_params.png", "kl_after_vs_staleness.png"):
        assert (tmp_path / "workers1" / name).stat().st_size > 0
    assert "| 0.5 |" in (tmp_path / "workers1" / "results.md").read_text()

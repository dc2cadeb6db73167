"""Corrector: identity at init, the query fold used by search, the standardized input, safetensors round trip."""

import pytest
import torch

from rag_train.models.corrector import Corrector


def _trained_like(dim=8, hidden=16, seed=0):
    torch.manual_seed(seed)
    corrector = Corrector(dim, hidden)
    for param in corrector.parameters():
        torch.nn.init.normal_(param, std=0.5)
    return corrector


def test_identity_at_init():
    corrector = Corrector(8, 32)
    stale = torch.randn(50, 8)
    assert torch.equal(corrector(stale), stale)
    assert torch.count_nonzero(corrector.second.weight) == 0 and torch.count_nonzero(corrector.second.bias) == 0


def test_forward_matches_formula():
    corrector = _trained_like()
    stale = torch.randn(20, 8)
    w1, c1 = corrector.first.weight, corrector.first.bias
    w2, c2 = corrector.second.weight, corrector.second.bias
    expected = stale + torch.relu(stale @ w1.T + c1) @ w2.T + c2
    torch.testing.assert_close(corrector(stale), expected)


def test_fold_gives_corrected_scores():
    corrector = _trained_like()
    stale, queries = torch.randn(30, 8), torch.randn(5, 8)
    q_hidden, q_bias = corrector.fold_queries(queries)
    buffer = torch.empty(30, 16)
    activations = corrector.hidden_activations(stale, out=buffer)
    assert activations.data_ptr() == buffer.data_ptr()
    folded = queries @ stale.T + q_hidden @ activations.T + q_bias[:, None]
    torch.testing.assert_close(folded, queries @ corrector(stale).T, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip(tmp_path):
    corrector = _trained_like(dim=6, hidden=10)
    path = tmp_path / "corrector.safetensors"
    corrector.save(path)
    loaded = Corrector.load(path)
    assert (loaded.dim, loaded.hidden) == (6, 10)
    stale = torch.randn(4, 6)
    assert torch.equal(loaded(stale), corrector(stale))


def _standardized(dim=8, hidden=16):
    corrector = _trained_like(dim, hidden)
    standardized = Corrector(dim, hidden, standardize=True)
    standardized.load_state_dict(corrector.state_dict(), strict=False)  # the same W1, c1, W2, c2
    mean, std = torch.randn(dim) * 3, torch.rand(dim) + 0.5
    std[1] = 0.0  # a constant dimension: left unscaled
    standardized.set_input_statistics(mean, std)
    return corrector, standardized, mean, torch.where(std > 0, std, torch.ones_like(std))


def test_standardized_input_is_the_plain_corrector_on_standardized_vectors():
    """h_std(b) = b + W2 relu(W1 (b - mean) / sd + c1) + c2, by hand; identity at init still; the search fold
    (hidden_activations + fold_queries) gives the same scores; a plain corrector cannot take statistics."""
    corrector, standardized, mean, std = _standardized()
    stale, queries = torch.randn(30, 8) * 2 + 1, torch.randn(5, 8)
    x = (stale - mean) / std
    w1, c1, w2, c2 = corrector.first.weight, corrector.first.bias, corrector.second.weight, corrector.second.bias
    torch.testing.assert_close(standardized(stale), stale + torch.relu(x @ w1.T + c1) @ w2.T + c2)
    torch.testing.assert_close(standardized.hidden_activations(stale), torch.relu(x @ w1.T + c1), rtol=1e-5, atol=1e-5)
    q_hidden, q_bias = standardized.fold_queries(queries)
    folded = queries @ stale.T + q_hidden @ standardized.hidden_activations(stale).T + q_bias[:, None]
    torch.testing.assert_close(folded, queries @ standardized(stale).T, rtol=1e-4, atol=1e-4)
    fresh = Corrector(8, 16, standardize=True)
    fresh.set_input_statistics(mean, std)
    assert torch.equal(fresh(stale), stale)
    with pytest.raises(ValueError, match="standardize=True"):
        corrector.set_input_statistics(mean, std)


def test_standardized_round_trip(tmp_path):
    _, standardized, _, _ = _standardized(dim=8, hidden=16)
    standardized.save(tmp_path / "c.safetensors")
    loaded = Corrector.load(tmp_path / "c.safetensors")
    stale = torch.randn(4, 8)
    assert loaded.standardize and torch.equal(loaded(stale), standardized(stale))


def test_load_rejects_other_files(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="not a corrector file"):
        Corrector.load(path)
    with pytest.raises(FileNotFoundError):
        Corrector.load(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="hidden > 0"):
        Corrector(4, 0)

"""Losses against hand computations (numpy / plain Python) and hand-derived gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from rag_train.losses import (
    cache_ce,
    cache_positive_probability,
    cache_surrogate,
    corrector_ce,
    corrector_mse,
    perplexity_distillation,
    retrieval_scores,
    sample_cache_negative,
    truncated_softmax_ce,
)


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


SCORES = np.array([[1.0, 2.0, 0.5, -1.0], [0.3, -0.2, 2.5, 1.1]])
OTHER = np.array([[0.2, 1.5, 0.1, 0.0], [1.0, 0.0, -1.0, 2.0]])


def leaf(x: np.ndarray, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype, requires_grad=True)


def test_retrieval_scores_shared_and_per_query():
    rng = np.random.default_rng(0)
    q, shared, per_query = rng.normal(size=(2, 3)), rng.normal(size=(4, 3)), rng.normal(size=(2, 4, 3))
    expected_shared = [[sum(q[b, d] * shared[s, d] for d in range(3)) for s in range(4)] for b in range(2)]
    expected_per = [[sum(q[b, d] * per_query[b, s, d] for d in range(3)) for s in range(4)] for b in range(2)]
    np.testing.assert_allclose(retrieval_scores(torch.tensor(q), torch.tensor(shared)).numpy(), expected_shared)
    np.testing.assert_allclose(retrieval_scores(torch.tensor(q), torch.tensor(per_query)).numpy(), expected_per)
    with pytest.raises(ValueError, match="must be"):
        retrieval_scores(torch.tensor(q), torch.tensor(per_query[:1]))


def test_truncated_softmax_ce_value_and_gradient():
    target, tau = np.array([1, 2]), 0.5
    scores = leaf(SCORES)
    loss = truncated_softmax_ce(scores, torch.tensor(target), temperature=tau)
    probs = np_softmax(SCORES / tau)
    hand = np.mean([-math.log(probs[b, target[b]]) for b in range(2)])
    assert loss.item() == pytest.approx(hand, abs=1e-12)
    loss.backward()
    onehot = np.eye(4)[target]
    np.testing.assert_allclose(scores.grad.numpy(), (probs - onehot) / tau / 2, atol=1e-12)


def test_truncated_softmax_ce_through_vectors_gradcheck():
    q = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    p = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 4, 5])
    assert torch.autograd.gradcheck(lambda a, b: truncated_softmax_ce(retrieval_scores(a, b), target, 0.3), (q, p))


def test_half_precision_scores_are_widened():
    """A large beta on fp16 scores: the loss still matches the fp64 reference to fp32 accuracy."""
    scores = torch.tensor(SCORES, dtype=torch.float16)
    loss = truncated_softmax_ce(scores, torch.tensor([3, 0]), temperature=0.01)
    exact = truncated_softmax_ce(scores.double(), torch.tensor([3, 0]), temperature=0.01)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(exact.item(), rel=1e-6)


def test_perplexity_distillation_value_gradient_and_stop_gradient():
    tau_r, tau_a = 0.5, 2.0
    retriever, reader = leaf(SCORES), leaf(OTHER)
    loss = perplexity_distillation(retriever, reader, retriever_temperature=tau_r, reader_temperature=tau_a)
    p_a, p_r = np_softmax(OTHER / tau_a), np_softmax(SCORES / tau_r)
    hand = np.mean([sum(p_a[b, i] * math.log(p_a[b, i] / p_r[b, i]) for i in range(4)) for b in range(2)])
    assert loss.item() == pytest.approx(hand, abs=1e-12)
    loss.backward()
    np.testing.assert_allclose(retriever.grad.numpy(), (p_r - p_a) / tau_r / 2, atol=1e-12)
    assert reader.grad is None
    same = perplexity_distillation(torch.tensor(SCORES), torch.tensor(SCORES * 2), 1.0, 2.0)
    assert same.item() == pytest.approx(0.0, abs=1e-12)


def test_corrector_ce_value_gradient_and_stop_gradient():
    tau = 0.5
    fresh, corrected = leaf(SCORES), leaf(OTHER)
    loss = corrector_ce(fresh, corrected, temperature=tau)
    p, p_h = np_softmax(SCORES / tau), np_softmax(OTHER / tau)
    hand = np.mean([-sum(p[b, i] * math.log(p_h[b, i]) for i in range(4)) for b in range(2)])
    assert loss.item() == pytest.approx(hand, abs=1e-12)
    loss.backward()
    np.testing.assert_allclose(corrected.grad.numpy(), (p_h - p) / tau / 2, atol=1e-12)
    assert fresh.grad is None


def test_corrector_losses_train_only_the_corrector_side():
    """Fresh vectors come from the encoders: neither corrector loss may send them a gradient."""
    q = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    h = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    (corrector_ce(retrieval_scores(q, g), retrieval_scores(q.detach(), h)) + corrector_mse(g, h)).backward()
    assert q.grad is None and g.grad is None and h.grad.abs().sum() > 0


def test_corrector_mse_value_and_gradient():
    fresh, corrected = leaf(SCORES), leaf(OTHER)
    loss = corrector_mse(fresh, corrected)
    hand = np.mean([sum((OTHER[b, i] - SCORES[b, i]) ** 2 for i in range(4)) for b in range(2)])
    assert loss.item() == pytest.approx(hand, abs=1e-12)
    loss.backward()
    np.testing.assert_allclose(corrected.grad.numpy(), (OTHER - SCORES), atol=1e-12)  # 2 diff / 2 rows
    assert fresh.grad is None


# --------------------------------------------------------------------------------------------------
# Negative cache (streaming)
# --------------------------------------------------------------------------------------------------

CACHE = np.array([[0.5, 1.5, -0.5, 1.5, 0.2], [2.0, -1.0, 0.3, 0.7, 0.0]])
IS_POS = np.array([[False, False, True, False, True], [False, False, False, False, False]])
POS = np.array([1.2, 0.4])


def test_cache_ce_hand_formula():
    alpha, tau = 0.25, 0.5
    loss = cache_ce(torch.tensor(POS), torch.tensor(CACHE), torch.tensor(IS_POS), alpha, tau)
    per_row = []
    for b in range(2):
        negatives = sum(math.exp(CACHE[b, j] / tau) for j in range(5) if not IS_POS[b, j])
        positive = math.exp(POS[b] / tau)
        per_row.append(-math.log(positive / (positive + negatives / alpha)))
    assert loss.item() == pytest.approx(np.mean(per_row), abs=1e-12)
    p_y = cache_positive_probability(torch.tensor(POS), torch.tensor(CACHE), torch.tensor(IS_POS), alpha, tau)
    np.testing.assert_allclose(p_y.numpy(), np.exp(-np.array(per_row)), atol=1e-12)


def test_cache_ce_with_whole_corpus_is_full_softmax_ce():
    scores = torch.tensor(SCORES)
    positive = torch.tensor([2, 0])
    negatives_mask = torch.nn.functional.one_hot(positive, 4).bool()
    full = truncated_softmax_ce(scores, positive, 0.7)
    cached = cache_ce(scores[torch.arange(2), positive], scores, negatives_mask, alpha=1.0, temperature=0.7)
    assert cached.item() == pytest.approx(full.item(), abs=1e-12)


def test_surrogate_gradient_in_expectation_equals_cache_ce_gradient():
    """Tiny linear encoders: sum_j q_j grad[beta (1-p_y)(s_J - s_y)] = grad cache CE, q_j ∝ e^{beta s_j}."""
    torch.manual_seed(4)
    alpha, tau = 0.5, 0.7
    x, docs = 0.5 * torch.randn(1, 3, dtype=torch.float64), 0.5 * torch.randn(6, 3, dtype=torch.float64)
    w_query = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w_doc = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    cache_rows = torch.tensor([1, 2, 2, 3, 0, 5])  # multiset: row 2 twice, the positive (0) once
    is_pos = (cache_rows == 0)[None]

    def scores():
        return (x @ w_query) @ (docs @ w_doc).T  # [1, 6] over documents

    s = scores()
    cache_ce(s[:, 0], s[:, cache_rows], is_pos, alpha, tau).backward()
    expected = (w_query.grad.clone(), w_doc.grad.clone())
    w_query.grad = w_doc.grad = None

    with torch.no_grad():
        s = scores()
        p_y = cache_positive_probability(s[:, 0], s[:, cache_rows], is_pos, alpha, tau)
        assert 0.1 < p_y.item() < 0.9  # so the (1 - p_y) factor matters
        weights = torch.softmax((s[:, cache_rows] / tau).masked_fill(is_pos, -math.inf), dim=1)[0]
    for slot in range(len(cache_rows)):
        if weights[slot] > 0:
            s = scores()
            loss = cache_surrogate(s[:, 0], s[:, cache_rows[slot]], p_y, tau) * weights[slot]
            loss.backward()
    torch.testing.assert_close(w_query.grad, expected[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w_doc.grad, expected[1], rtol=1e-10, atol=1e-12)


def test_surrogate_stops_gradient_through_positive_probability():
    p_y = torch.tensor([0.25], requires_grad=True)
    pos, neg = leaf(np.array([0.3])), leaf(np.array([1.1]))
    loss = cache_surrogate(pos, neg, p_y, temperature=0.5)
    assert loss.item() == pytest.approx((1 - 0.25) * (1.1 - 0.3) / 0.5)
    loss.backward()
    assert p_y.grad is None
    assert pos.grad.item() == pytest.approx(-0.75 / 0.5) and neg.grad.item() == pytest.approx(0.75 / 0.5)


def test_gumbel_negative_frequencies_follow_softmax_by_multiplicity():
    tau, draws = 0.5, 40000
    scores = torch.tensor([0.0, 0.4, 1.0, 0.4, -0.5, 2.0])
    doc_of_slot = [7, 3, 9, 3, 4, 1]  # doc 3 cached twice; doc 1 is the positive
    is_pos = torch.tensor([d == 1 for d in doc_of_slot])
    picks = sample_cache_negative(
        scores.expand(draws, -1), is_pos.expand(draws, -1), tau, torch.Generator().manual_seed(0)
    )
    assert not is_pos[picks].any()
    docs = [7, 3, 9, 4]
    observed = [sum((picks == slot).sum().item() for slot, d in enumerate(doc_of_slot) if d == doc) for doc in docs]
    weight = {doc: sum(math.exp(scores[s].item() / tau) for s, d in enumerate(doc_of_slot) if d == doc) for doc in docs}
    total = sum(weight.values())
    expected = [draws * weight[doc] / total for doc in docs]
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    with pytest.raises(ValueError, match="no negative"):
        sample_cache_negative(scores[None, :1], torch.tensor([[True]]))

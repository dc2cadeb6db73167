"""Retrieval losses as pure functions of scores / vectors (all math in float32 or wider).

Shapes: B queries, S passages in a truncated-softmax subset, D embedding dim. `temperature` tau gives
beta = 1 / tau on retriever scores. Every loss is a mean over the batch. Stop-gradients are part of the
definitions (seed 000): teacher distributions are detached inside the functions, so a caller cannot
leak a gradient into the wrong network by forgetting a `.detach()`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp16 / bf16 scores lose the softmax tail at large beta: compute in fp32 (keep fp64 for gradcheck)."""
    return x if x.dtype == torch.float64 else x.float()


def retrieval_scores(query_vectors: torch.Tensor, passage_vectors: torch.Tensor) -> torch.Tensor:
    """<f(x_i), g(y)> as [B, S]; passages shared by the batch [S, D] (Alg. 1) or per query [B, S, D] (Alg. 2)."""
    q = _wide(query_vectors)
    p = _wide(passage_vectors)
    with torch.autocast(q.device.type, enabled=False):  # fp32 inside a mixed-precision (autocast) forward too
        if p.dim() == 2:
            return q @ p.T
        if p.dim() == 3 and p.shape[0] == q.shape[0]:
            return torch.einsum("bd,bsd->bs", q, p)
    raise ValueError(f"passage vectors must be [S, D] or [B={q.shape[0]}, S, D], got {tuple(p.shape)}")


def truncated_softmax_ce(scores: torch.Tensor, target_index: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Cross-entropy of softmax(beta * scores[B, S]) over the subset S against one positive per row.

    The caller guarantees the positive is in S (Alg. 1 always inserts it); `target_index[B]` is its column.
    """
    return F.cross_entropy(_wide(scores) / temperature, target_index)


def perplexity_distillation(
    retriever_scores: torch.Tensor,
    reader_loglik: torch.Tensor,
    retriever_temperature: float = 1.0,
    reader_temperature: float = 1.0,
) -> torch.Tensor:
    """KL(P_a || P~) (Atlas), P_a = softmax(reader_loglik[B, P] / reader_temp) as a detached target,
    P~ = softmax(retriever_scores[B, P] / retriever_temp): trains only the retriever."""
    if retriever_scores.shape != reader_loglik.shape:
        raise ValueError(f"retriever scores {tuple(retriever_scores.shape)} != reader {tuple(reader_loglik.shape)}")
    log_target = torch.log_softmax(_wide(reader_loglik.detach()) / reader_temperature, dim=-1)
    log_student = torch.log_softmax(_wide(retriever_scores) / retriever_temperature, dim=-1)
    return F.kl_div(log_student, log_target, log_target=True, reduction="batchmean")


def corrector_ce(fresh_scores: torch.Tensor, corrected_scores: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """CE(P~ || P~_h) (seed 000, Eq. 6): -sum_y P~(y) log P~_h(y) over the same subset [B, S].

    P~ comes from fresh vectors and is detached: the gradient reaches only the corrector's scores."""
    if fresh_scores.shape != corrected_scores.shape:
        raise ValueError(f"fresh scores {tuple(fresh_scores.shape)} != corrected {tuple(corrected_scores.shape)}")
    target = torch.softmax(_wide(fresh_scores.detach()) / temperature, dim=-1)
    log_corrected = torch.log_softmax(_wide(corrected_scores) / temperature, dim=-1)
    return -(target * log_corrected).sum(dim=-1).mean()


def corrector_mse(fresh_vectors: torch.Tensor, corrected_vectors: torch.Tensor) -> torch.Tensor:
    """||g(y) - h(B[y])||^2 (seed 000, Eq. 5), mean over rows [..., D]; g(y) detached."""
    if fresh_vectors.shape != corrected_vectors.shape:
        raise ValueError(f"fresh vectors {tuple(fresh_vectors.shape)} != corrected {tuple(corrected_vectors.shape)}")
    diff = _wide(corrected_vectors) - _wide(fresh_vectors.detach())
    return diff.pow(2).sum(dim=-1).mean()


# ---------------------------------------------------------------------------------------------------
# Negative cache, streaming variant (seed 004, Algorithm 2)
# cache_scores[B, C]: scores against the C cache entries (a multiset, duplicates allowed);
# cache_is_positive[B, C]: True where the entry is row i's own positive (every copy is removed).
# ---------------------------------------------------------------------------------------------------


def _shifted_cache_logits(
    positive_scores: torch.Tensor,
    cache_scores: torch.Tensor,
    cache_is_positive: torch.Tensor,
    alpha: float,
    temperature: float,
) -> torch.Tensor:
    """[B, 1 + C] logits beta*s: positive first, negatives shifted by log(1/alpha), positive copies -inf."""
    if not 0 < alpha:
        raise ValueError(f"alpha={alpha} must be > 0 (cache size / corpus size)")
    negatives = _wide(cache_scores) / temperature - math.log(alpha)
    negatives = negatives.masked_fill(cache_is_positive, float("-inf"))
    return torch.cat([_wide(positive_scores).unsqueeze(1) / temperature, negatives], dim=1)


def cache_ce(
    positive_scores: torch.Tensor,
    cache_scores: torch.Tensor,
    cache_is_positive: torch.Tensor,
    alpha: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """-log e^{b s_y} / (e^{b s_y} + (1/alpha) sum_{j in S, j != y} e^{b s_j}), mean over B.

    An unbiased-denominator estimate of the full-corpus softmax CE; log it (the surrogate's value is not it)."""
    logits = _shifted_cache_logits(positive_scores, cache_scores, cache_is_positive, alpha, temperature)
    return (torch.logsumexp(logits, dim=1) - logits[:, 0]).mean()


def cache_positive_probability(
    positive_scores: torch.Tensor,
    cache_scores: torch.Tensor,
    cache_is_positive: torch.Tensor,
    alpha: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """p_y [B] under the cache softmax (detached): the (1 - p_y) factor of the surrogate loss."""
    with torch.no_grad():
        logits = _shifted_cache_logits(positive_scores, cache_scores, cache_is_positive, alpha, temperature)
        return torch.softmax(logits, dim=1)[:, 0]


def sample_cache_negative(
    cache_scores: torch.Tensor,
    cache_is_positive: torch.Tensor,
    temperature: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """J [B] ~ softmax(beta s~) over the non-positive cache entries (Gumbel-max, independent noise per copy,
    so duplicates count by multiplicity). One draw per query."""
    scores = _wide(cache_scores.detach())
    if bool(cache_is_positive.all(dim=1).any()):
        raise ValueError("a query has no negative left in the cache (every entry is its positive)")
    uniform = torch.rand(scores.shape, generator=generator, dtype=scores.dtype, device=scores.device)
    tiny = torch.finfo(scores.dtype).tiny
    uniform = uniform.clamp(min=tiny, max=1.0 - torch.finfo(scores.dtype).eps)
    gumbel = -torch.log(-torch.log(uniform))
    perturbed = (scores / temperature + gumbel).masked_fill(cache_is_positive, float("-inf"))
    return perturbed.argmax(dim=1)


def cache_surrogate(
    positive_scores: torch.Tensor,
    sampled_scores: torch.Tensor,
    positive_probability: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """beta (1 - p_y) (s_iJ - s_iy), mean over B: its gradient, in expectation over J, is the cache CE's.

    `positive_scores` and `sampled_scores` [B] are FRESH scores with gradient (query vs. re-encoded
    positive and z_J); `positive_probability` is `cache_positive_probability` (treated as a constant)."""
    weight = 1.0 - _wide(positive_probability.detach())
    return (weight * (_wide(sampled_scores) - _wide(positive_scores)) / temperature).mean()

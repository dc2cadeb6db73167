"""Nyström low-dimensional target representations and the regression re-encoding of seed 001 (Monath et al.
2023, §4, Appendix B, Algorithms 5 and 6), in host memory (numpy).

Kernel: the inner product of target vectors (the similarity the dual encoder scores with). With d' landmark
vectors L [d', d] and G = L L^T, a target b is represented by t = G^(+1/2) L b (its similarities to the landmarks,
K S, whitened by (S^T K S)^(-1/2)): <t_x, t_y> is the Nyström approximation of <x, y>, t is the target's
approximate vector b^ = L^T G^+ L b (its projection onto the landmarks' span) in an orthonormal basis of that span,
so Euclidean distances between t's equal those between the b^'s (the SG tree's metric), and <q, b^> = <q P, t>
with P = L^T G^(+1/2). Exact (b^ = b) when the landmarks span the vectors.

Re-encoding (every w steps): s' targets are re-encoded with the current encoder, V [s', d]; a ridge regression
W [d', d] from their cached representations T_s to V (kernel ridge regression with the Nyström kernel) maps every
cached t to a new approximate vector t W; the landmarks are re-encoded too and give the new projection, so the whole
cache moves by one [d', d'] matrix: T <- T W P_new.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def whitening(landmarks: np.ndarray, rel_eps: float = 1e-10) -> np.ndarray:
    """P = L^T G^(+1/2) [d, d'] for landmark vectors L [d', d] (pseudo-inverse: directions with eigenvalue below
    rel_eps * the largest are dropped)."""
    lm = np.asarray(landmarks, dtype=np.float64)
    values, vectors = np.linalg.eigh(lm @ lm.T)
    keep = values > rel_eps * max(values.max(), 1e-300)
    inv_sqrt = np.zeros_like(values)
    inv_sqrt[keep] = 1.0 / np.sqrt(values[keep])
    return lm.T @ (vectors * inv_sqrt) @ vectors.T


def represent(vectors: np.ndarray, projection: np.ndarray, chunk: int = 65536,
              decode: Callable[[np.ndarray], np.ndarray] = np.asarray) -> np.ndarray:
    """Low-dimensional representations t = b P of full vectors [n, d] -> [n, d'] float32, `chunk` rows at a time
    (`decode`: stored rows -> floats, e.g. a buffer's bfloat16 bits, applied per chunk)."""
    out = np.empty((len(vectors), projection.shape[1]), dtype=np.float32)
    for start in range(0, len(vectors), chunk):
        out[start:start + chunk] = np.asarray(decode(vectors[start:start + chunk]), dtype=np.float64) @ projection
    return out


def reconstruct(low: np.ndarray, projection: np.ndarray) -> np.ndarray:
    """Approximate full vectors b^ = t P^T [n, d]."""
    return np.asarray(low, dtype=np.float64) @ projection.T


def fit_regression(low: np.ndarray, fresh: np.ndarray, ridge: float) -> np.ndarray:
    """W [d', d] = argmin ||T W - V||^2 + lam ||W||^2 with lam = ridge * mean eigenvalue of T^T T."""
    t = np.asarray(low, dtype=np.float64)
    gram = t.T @ t
    lam = ridge * np.trace(gram) / len(gram)
    return np.linalg.solve(gram + lam * np.eye(len(gram)), t.T @ np.asarray(fresh, dtype=np.float64))


def reencode(low: np.ndarray, regression: np.ndarray, new_projection: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Every cached representation mapped through the regression and the new landmarks: T W P_new."""
    return represent(low, regression @ new_projection, chunk)

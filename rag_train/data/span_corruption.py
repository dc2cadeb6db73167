"""T5's pre-training objective, span corruption (Raffel et al. 2020, section 3.1.4), on token id sequences.

About `noise_density` of each sequence's tokens are dropped in spans of mean length `mean_span_length`; the input
keeps the other tokens with one sentinel (`<extra_id_0>`, `<extra_id_1>`, ...) in place of each span, and the
target lists every sentinel followed by the tokens it replaced. Both end with EOS. No library ships this as a
function (transformers has it only inside an example script), so it is written here, with numpy and a caller's
`numpy.random.Generator` so a seed fixes every mask.
"""

from __future__ import annotations

import numpy as np


def _split_into_segments(items: int, segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths (each >= 1, summing to `items`) of a uniformly random split of `items` into `segments` runs."""
    cuts = np.sort(rng.choice(np.arange(1, items), size=segments - 1, replace=False)) if segments > 1 else []
    edges = np.concatenate([[0], cuts, [items]])
    return np.diff(edges).astype(np.int64)


def noise_mask(length: int, noise_density: float, mean_span_length: float, rng: np.random.Generator) -> np.ndarray:
    """Boolean [length] mask of the tokens to drop: round(length * density) of them (at least 1, at most
    length - 1), in round(noise / mean_span_length) spans (at least 1) that alternate with kept runs, the
    sequence starting with a kept run, as in T5's `random_spans_noise_mask`."""
    if length < 2:
        raise ValueError(f"span corruption needs sequences of at least 2 tokens, got {length}")
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    spans = min(max(int(round(noise / mean_span_length)), 1), noise, length - noise)
    noise_lengths = _split_into_segments(noise, spans, rng)
    kept_lengths = _split_into_segments(length - noise, spans, rng)
    mask = np.zeros(length, dtype=bool)
    position = 0
    for kept, dropped in zip(kept_lengths, noise_lengths):
        position += kept
        mask[position:position + dropped] = True
        position += dropped
    return mask


def corrupt(ids: np.ndarray, mask: np.ndarray, sentinels: list[int], eos: int) -> tuple[list[int], list[int]]:
    """(input ids, target ids) of one sequence `ids` (without EOS) under `mask`; `sentinels[i]` replaces span i."""
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    if int(starts.sum()) > len(sentinels):
        raise ValueError(f"{int(starts.sum())} noise spans but only {len(sentinels)} sentinel tokens")
    span = np.cumsum(starts) - 1  # span index of every noise token
    inputs, targets = [], []
    for token, noisy, start, index in zip(ids.tolist(), mask.tolist(), starts.tolist(), span.tolist()):
        if not noisy:
            inputs.append(token)
            continue
        if start:
            inputs.append(sentinels[index])
            targets.append(sentinels[index])
        targets.append(token)
    return inputs + [eos], targets + [eos]


def sentinel_ids(tokenizer) -> list[int]:
    """`<extra_id_0>`, `<extra_id_1>`, ... as ids, for a T5 tokenizer (real or the toy one)."""
    ids = tokenizer.convert_tokens_to_ids([f"<extra_id_{i}>" for i in range(100)])
    found = [i for i in ids if i is not None and i != tokenizer.unk_token_id]
    if len(found) < 100:
        raise ValueError("span corruption needs a T5 tokenizer with the 100 <extra_id_N> sentinel tokens")
    return found

"""Top-k (or Gumbel-max sampled) buffer rows for a batch of queries, in one API for every mode.

- `exact`: top-k of <q, b> over the stale rows.
- `corrector_full`: top-k of <q, h(b)> over every row; the corrector's second layer is folded into
  the queries so each row costs one (D x hidden) product, never a materialised h(B)
  (rag_train/buffer/chunk_scores.py scores a chunk; with `fused` from one torch.compile'd function).
- `corrector_rerank`: FAISS candidates from the stale rows, re-scored exactly with h.

Rows are scanned in chunks of `chunk_rows` (peak extra memory O(chunk x (hidden + k))), each chunk's
top-k is merged into a running top-k. Ties go to the lower global row: a chunk's torch.topk takes
k+1 to spot a tie across the k-th place (only those queries are redone with a stable sort), and every
merge is a stable sort by row followed by a stable sort by key (`merge_topk`). On CPU everything is
computed in fp32; on GPU in the buffer dtype with fp32 scores.
Memory-mapped rows are copied chunk by chunk into one reused fp32 buffer and the file pages are
dropped from the process afterwards, so resident memory stays flat however large the buffer is.
With torch.distributed initialised each rank passes its own shard (`row_offset` = its first global
row) and the same queries (all-gather each rank's batch first); per-rank results are gathered and
merged, equal on every rank and to a single-process search.

The chunked scan, the tie rule and the Gumbel noise must give the same rows whatever the chunking or sharding: kept
together here, where one reading checks that they agree; a chunk's scores come from chunk_scores.py.
"""

from __future__ import annotations

import copy
import mmap
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from rag_train.buffer.chunk_scores import CpuScorer, DeviceScorer
from rag_train.buffer.distributed import (
    PAD_ROW,
    check_shards_and_share_seed,
    is_sharded,
    merge_across_ranks,
    merge_topk,
)
from rag_train.models.corrector import Corrector

MODES = ("exact", "corrector_full", "corrector_rerank")
SAMPLINGS = ("topk", "gumbel")
# numpy rows searched as they are: a Buffer stores bfloat16 as its uint16 bits (rag_train/buffer/store.py)
NUMPY_ROW_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16,
                    "uint16": torch.bfloat16}
NOISE_BLOCK = 8192  # Gumbel noise is drawn per block of global rows, so it is independent of chunking and sharding
HIDDEN_TILE_BYTES = 16 << 20  # [tile, hidden] activations sized to stay in a typical L3 between the two GEMMs
UNIFORM_EPS = 1e-7  # uniforms clamped to [eps, 1 - eps] so the Gumbel transform stays finite

Rows = Union[torch.Tensor, np.ndarray]


@dataclass
class SearchResult:
    scores: torch.Tensor  # [B, k] fp32: <q, b> or <q, h(b)> of the returned rows (never the Gumbel keys)
    rows: torch.Tensor  # [B, k] int64 global row ids, ordered by key desc then row asc


def search(
    queries: torch.Tensor,
    rows: Rows,
    k: int,
    corrector: Optional[Corrector] = None,
    mode: str = "exact",
    chunk_rows: int = 65536,
    exclude: Optional[torch.Tensor] = None,
    sampling: str = "topk",
    temperature: float = 1.0,
    generator: Optional[torch.Generator] = None,
    row_offset: int = 0,
    faiss_index=None,
    candidates: int = 1024,
    group=None,
    fused: bool = False,
) -> SearchResult:
    """Top-k rows (or k Gumbel-max samples without replacement) of `rows` for each query.

    `exclude` [B, E] holds global row ids never to return (-1 = padding). Gumbel sampling returns the
    top-k of score/temperature + Gumbel noise; the noise comes from `generator` (one draw per call,
    rank 0's when sharded) so a seeded generator reproduces the samples. `faiss_index` (rerank only)
    is a built index over this shard's rows in row order, or a factory string (`build_faiss_index`).
    `fused` (corrector_full only; the other modes ignore it) scores each chunk with `FusedChunk`: the same rows,
    scores equal up to the order of fp32 additions.
    """
    n_local = _validate(queries, rows, k, corrector, mode, chunk_rows, exclude, sampling, temperature, row_offset)
    queries = queries.detach().float() if queries.device.type == "cpu" else queries.detach()
    if exclude is not None:
        exclude = exclude.to(device=queries.device, dtype=torch.int64)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator)) if sampling == "gumbel" else 0
    sharded = is_sharded(group)
    total_rows = n_local
    if sharded:
        seed, total_rows = check_shards_and_share_seed(row_offset, n_local, queries, seed, group)
    if k > total_rows:
        raise ValueError(f"search: k={k} is larger than the number of buffer rows ({total_rows})")
    noise = _GumbelNoise(seed, temperature) if sampling == "gumbel" else None
    with torch.no_grad():
        if n_local == 0:  # an empty shard still takes part in the gather
            empty = torch.empty(queries.shape[0], 0, device=queries.device)
            local = _pad_to_k(empty, empty.long(), empty, k)
        elif mode == "corrector_rerank":
            local = _rerank(queries, rows, k, corrector, exclude, noise, row_offset, faiss_index, candidates,
                            chunk_rows)
        else:
            full = mode == "corrector_full"
            local = _scan(queries, rows, k, corrector if full else None, exclude, noise, row_offset, chunk_rows,
                          fused=fused and full)
        keys, found, scores = merge_across_ranks(*local, k, group) if sharded else local
    if torch.isneginf(keys).any():
        raise ValueError(f"search: fewer than k={k} rows are left for some query after `exclude`")
    return SearchResult(scores=scores.float(), rows=found)


def _validate(queries, rows, k, corrector, mode, chunk_rows, exclude, sampling, temperature, row_offset):
    if mode not in MODES:
        raise ValueError(f"search: mode={mode!r} is not one of {list(MODES)}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"search: sampling={sampling!r} is not one of {list(SAMPLINGS)}")
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2:
        raise ValueError(f"search: queries must be a [B, D] tensor, got {type(queries).__name__} "
                         f"{tuple(getattr(queries, 'shape', ()))}")
    if not isinstance(rows, (torch.Tensor, np.ndarray)) or rows.ndim != 2:
        raise ValueError(f"search: rows must be a [N, D] tensor or numpy (memmap) array, got {type(rows).__name__}")
    if rows.shape[1] != queries.shape[1]:
        raise ValueError(f"search: queries have dim {queries.shape[1]} but rows have dim {rows.shape[1]}")
    if isinstance(rows, np.ndarray) and rows.dtype.name not in NUMPY_ROW_DTYPES:
        raise ValueError(f"search: rows dtype {rows.dtype} not supported (float16, float32, bfloat16 as ml_dtypes' "
                         "type or as its uint16 bits)")
    if not torch.isfinite(queries).all():
        raise ValueError("search: queries contain NaN or inf")
    if mode == "corrector_full" and corrector is None:
        raise ValueError("search: mode='corrector_full' needs a corrector")
    if corrector is not None and corrector.dim != queries.shape[1]:
        raise ValueError(f"search: corrector dim {corrector.dim} != query dim {queries.shape[1]}")
    if corrector is not None and corrector.device != queries.device:
        raise ValueError(f"search: corrector is on {corrector.device} but queries on {queries.device}")
    if k <= 0 or chunk_rows <= 0 or row_offset < 0:
        raise ValueError(f"search: need k > 0, chunk_rows > 0, row_offset >= 0 (got {k}, {chunk_rows}, {row_offset})")
    if not temperature > 0:
        raise ValueError(f"search: temperature must be > 0, got {temperature}")
    if exclude is not None and (exclude.dim() != 2 or exclude.shape[0] != queries.shape[0]):
        raise ValueError(f"search: exclude must be [B={queries.shape[0]}, E], got {tuple(exclude.shape)}")
    return rows.shape[0]


class _GumbelNoise:
    """Gumbel(0, 1) noise for (query, global row) pairs, from one generator per block of NOISE_BLOCK
    global rows seeded by (seed, block), so any chunking or sharding sees the same noise per row."""

    def __init__(self, seed: int, temperature: float):
        self.seed = seed
        self.temperature = temperature

    def _block_seed(self, block: int) -> int:
        z = (self.seed + 0x9E3779B97F4A7C15 * (block + 1)) & 0xFFFFFFFFFFFFFFFF  # splitmix64 finaliser
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF

    def for_range(self, batch: int, start: int, end: int, device: torch.device) -> torch.Tensor:
        """[batch, end - start] noise for global rows [start, end)."""
        out = torch.empty(batch, end - start, device=device)
        for block in range(start // NOISE_BLOCK, (end - 1) // NOISE_BLOCK + 1):
            first = block * NOISE_BLOCK
            gen = torch.Generator(device=device).manual_seed(self._block_seed(block))
            uniform = torch.rand(batch, NOISE_BLOCK, generator=gen, device=device)
            lo, hi = max(start, first), min(end, first + NOISE_BLOCK)
            out[:, lo - start:hi - start] = uniform[:, lo - first:hi - first]
        return out.clamp_(UNIFORM_EPS, 1 - UNIFORM_EPS).log_().neg_().log_().neg_()

    def keys(self, scores: torch.Tensor, global_rows_start: int) -> torch.Tensor:
        noise = self.for_range(scores.shape[0], global_rows_start, global_rows_start + scores.shape[1], scores.device)
        return noise.add_(scores.float(), alpha=1.0 / self.temperature)


def _mask_excluded(keys: torch.Tensor, exclude: Optional[torch.Tensor], start: int) -> None:
    """Set keys of excluded global rows in [start, start + width) to -inf, in place."""
    if exclude is None or exclude.numel() == 0:
        return
    local = exclude - start
    hit = (exclude >= 0) & (local >= 0) & (local < keys.shape[1])
    if hit.any():
        query = torch.arange(keys.shape[0], device=keys.device).unsqueeze(1).expand_as(exclude)
        keys[query[hit], local[hit]] = float("-inf")


def _chunk_topk(keys: torch.Tensor, k: int, ties: Optional[list] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values, local indices) of a chunk, lower index first among ties at the k-th place.

    torch.topk breaks ties arbitrarily; taking k+1 exposes queries whose k-th and (k+1)-th keys are
    equal, and only those rows are redone with a stable sort. Given a `ties` list, the fix is left out
    and a device flag "this chunk had such a tie" is appended instead (no host sync; see `_scan`)."""
    width = keys.shape[1]
    if k >= width:
        return torch.sort(keys, dim=1, descending=True, stable=True)
    values, index = keys.topk(k + 1, dim=1)
    tied = values[:, k - 1] == values[:, k]
    values, index = values[:, :k], index[:, :k]
    if ties is not None:
        ties.append(tied.any())
        return values, index
    tied = tied.nonzero().squeeze(1)
    if tied.numel():
        tied_values, tied_index = torch.sort(keys[tied], dim=1, descending=True, stable=True)
        values[tied], index[tied] = tied_values[:, :k], tied_index[:, :k]
    return values, index


class _ChunkReader:
    """Yields [n, D] compute-dtype blocks of rows; memmapped files go through one reused buffer and
    their pages are released after each chunk (madvise DONTNEED) so RSS stays flat."""

    def __init__(self, rows: Rows, chunk_rows: int, device: torch.device):
        self.rows, self.chunk_rows, self.device = rows, chunk_rows, device
        self.mapping = _find_mmap(rows) if isinstance(rows, np.ndarray) else None
        on_cpu = device.type == "cpu"
        dtype = torch.float32 if on_cpu else _torch_dtype(rows)
        needs_copy = isinstance(rows, np.ndarray) or rows.dtype != dtype or rows.device != device
        self.staging = torch.empty(min(chunk_rows, rows.shape[0]), rows.shape[1], dtype=dtype, device=device) \
            if needs_copy else None

    def __iter__(self):
        for start in range(0, self.rows.shape[0], self.chunk_rows):
            end = min(start + self.chunk_rows, self.rows.shape[0])
            source = self.rows[start:end]
            if self.staging is None:
                yield start, source
                continue
            block = self.staging[: end - start]
            block.copy_(_as_tensor(source) if isinstance(source, np.ndarray) else source)
            if self.mapping is not None:
                _release_pages(self.mapping, source)
            yield start, block


def _torch_dtype(rows: Rows) -> torch.dtype:
    if isinstance(rows, torch.Tensor):
        return rows.dtype
    return NUMPY_ROW_DTYPES[rows.dtype.name]


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a (possibly read-only memmapped) numpy block, bfloat16 included."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memmap: we only read from it
        if array.dtype.name in ("bfloat16", "uint16"):
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def _find_mmap(array: np.ndarray) -> Optional[mmap.mmap]:
    base = array
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        base = getattr(base, "_mmap", None) or getattr(base, "base", None)
    return None


def _release_pages(mapping: mmap.mmap, block: np.ndarray) -> None:
    """Drop the process's mapping of the pages `block` covers (the page cache keeps them)."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    start_address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    offset = block.ctypes.data - start_address
    aligned = offset - offset % mmap.PAGESIZE
    length = min(offset + block.nbytes, len(mapping)) - aligned
    if length > 0:
        mapping.madvise(mmap.MADV_DONTNEED, aligned, length)


def _scan(queries, rows, k, corrector, exclude, noise, row_offset, chunk_rows, defer_ties=None, fused=False):
    """Stream over all local rows: score each chunk, take its top-k, merge into the running top-k.

    With `defer_ties` (default: on an accelerator) the tie check at each chunk's k-th place is deferred:
    asking the host once per chunk stalls the device every chunk (exact search at 28M rows took 1.9x a
    one-shot top-k, docs/search_benchmark.md). One check at the end; if any chunk had such a tie the scan
    is redone with the per-chunk fix, so the result is the same either way."""
    args = (queries, rows, k, corrector, exclude, noise, row_offset, chunk_rows, fused)
    if defer_ties is None:
        defer_ties = queries.device.type != "cpu"
    if not defer_ties:
        return _scan_pass(*args, ties=None)
    ties = []  # one flag per chunk wider than k (narrower ones are sorted whole: no tie to fix)
    result = _scan_pass(*args, ties=ties)
    if ties and bool(torch.stack(ties).any()):
        result = _scan_pass(*args, ties=None)
    return result


def _scan_pass(queries, rows, k, corrector, exclude, noise, row_offset, chunk_rows, fused, ties):
    device = queries.device
    reader = _ChunkReader(rows, chunk_rows, device)
    compute_dtype = torch.float32 if device.type == "cpu" else _torch_dtype(rows)
    q = queries.to(compute_dtype)
    folded = None
    if corrector is not None:
        q_hidden, q_bias = corrector.fold_queries(queries.float())
        if corrector.dtype != compute_dtype:  # convert the small net once, not per tile
            corrector = copy.deepcopy(corrector).to(compute_dtype)
        folded = (q_hidden.to(compute_dtype), q_bias.float())
    block_rows = min(chunk_rows, rows.shape[0])
    scorer = (CpuScorer if device.type == "cpu" else DeviceScorer)(q, folded, corrector, block_rows, fused)
    score_store = torch.empty(queries.shape[0] * block_rows, device=device)
    best = None
    try:
        for start, block in reader:
            scores = score_store[: queries.shape[0] * block.shape[0]].view(queries.shape[0], block.shape[0])
            scores = scorer(block, scores)
            best = _merge_chunk(best, scores, noise, exclude, row_offset + start, k, ties)
    finally:
        scorer.close()
    return _pad_to_k(*best, k)


def _merge_chunk(best, scores, noise, exclude, global_start, k, ties):
    """Running top-k after one more chunk of scores [B, n] whose first row is `global_start`."""
    keys = noise.keys(scores, global_start) if noise is not None else scores
    _mask_excluded(keys, exclude, global_start)
    values, index = _chunk_topk(keys, k, ties)
    chunk_best = (values, index + global_start, scores.gather(1, index) if noise is not None else values)
    merged = chunk_best if best is None else tuple(torch.cat(p, 1) for p in zip(best, chunk_best))
    return merge_topk(*merged, k)  # also orders the first chunk's ties by row


def _pad_to_k(keys, found, scores, k):
    """Shards smaller than k still return [B, k] (padding: key -inf, row PAD_ROW) so ranks can gather."""
    missing = k - keys.shape[1]
    if missing <= 0:
        return keys, found, scores
    shape = (keys.shape[0], missing)
    return (torch.cat([keys, keys.new_full(shape, float("-inf"))], 1),
            torch.cat([found, found.new_full(shape, PAD_ROW)], 1),
            torch.cat([scores, scores.new_full(shape, float("-inf"))], 1))


def build_faiss_index(rows: Rows, factory: str = "Flat", chunk_rows: int = 65536, train_rows: int = 262144):
    """Inner-product FAISS index over `rows` (local row ids), trained on evenly spaced rows if needed."""
    import faiss

    n, dim = rows.shape
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(f"build_faiss_index: bad FAISS factory string {factory!r}: {exc}") from exc
    reader = _ChunkReader(rows, chunk_rows, torch.device("cpu"))
    if not index.is_trained:
        sample = np.linspace(0, n - 1, num=min(n, train_rows)).astype(np.int64)
        index.train(_as_float32_numpy(rows[sample] if isinstance(rows, np.ndarray) else rows[torch.from_numpy(sample)]))
    for _, block in reader:
        index.add(np.ascontiguousarray(block.numpy(), dtype=np.float32))
    return index


def _as_float32_numpy(block: Rows) -> np.ndarray:
    tensor = _as_tensor(np.ascontiguousarray(block)) if isinstance(block, np.ndarray) else block
    return tensor.detach().float().cpu().contiguous().numpy()


def _rerank(queries, rows, k, corrector, exclude, noise, row_offset, faiss_index, candidates, chunk_rows):
    """FAISS candidates from the stale rows, re-scored exactly with <q, h(b)> (or <q, b> without h)."""
    n_local = rows.shape[0]
    index = build_faiss_index(rows, faiss_index or "Flat", chunk_rows) if faiss_index is None or isinstance(
        faiss_index, str) else faiss_index
    if index.d != rows.shape[1] or index.ntotal != n_local:
        raise ValueError(f"search: faiss index has d={index.d}, ntotal={index.ntotal}; this shard has "
                         f"{n_local} rows of dim {rows.shape[1]}")
    extra = 0 if exclude is None else exclude.shape[1]
    wanted = min(n_local, candidates + extra)
    _, local_ids = index.search(queries.float().cpu().numpy(), wanted)
    local_ids = torch.from_numpy(local_ids).to(queries.device)
    valid = local_ids >= 0
    flat = local_ids.clamp(min=0).reshape(-1).cpu().numpy()
    if isinstance(rows, np.ndarray):
        vectors = _as_tensor(np.ascontiguousarray(rows[flat])).float()
        mapping = _find_mmap(rows)
        if mapping is not None:
            _release_pages(mapping, rows)
    else:
        vectors = rows[torch.from_numpy(flat).to(rows.device)].float()
    vectors = vectors.to(queries.device).view(*local_ids.shape, -1)
    if corrector is not None:
        per_tile = max(1, HIDDEN_TILE_BYTES // (4 * corrector.hidden * wanted))  # queries per corrector call
        vectors = torch.cat([corrector(tile.float()) for tile in vectors.split(per_tile)])
    scores = torch.bmm(vectors, queries.float().unsqueeze(2)).squeeze(2)
    global_rows = torch.where(valid, local_ids + row_offset, torch.full_like(local_ids, PAD_ROW))
    if noise is None:
        keys = scores.clone()
    else:
        keys = _candidate_noise(noise, queries.shape[0], wanted, row_offset, queries.device)
        keys.add_(scores, alpha=1 / noise.temperature)
    keys[~valid] = float("-inf")
    if exclude is not None and exclude.numel():
        keys[(global_rows.unsqueeze(2) == exclude.unsqueeze(1)).any(2)] = float("-inf")
    return _pad_to_k(*merge_topk(keys, global_rows, scores, k), k)


def _candidate_noise(noise: _GumbelNoise, batch: int, width: int, row_offset: int, device) -> torch.Tensor:
    """Noise for the candidate slots of this shard (candidates are not a row range: drawn per shard)."""
    return noise.for_range(batch, row_offset, row_offset + width, device)

"""The scores of one chunk of buffer rows against a batch of queries, for `search`: <q, b>, plus with a corrector
<W2^T q, relu(W1 b + c1)> + <q, c2> (its second layer folded into the queries: rag_train/models/corrector.py), fp32.

`DeviceScorer` runs a whole chunk per GEMM on an accelerator; `CpuScorer` splits the torch threads over row tiles
(docs/search_benchmark.md); `FusedChunk` gives the same sum from one torch.compile'd function (`search(fused=True)`).
Stale and corrected search use the same tiles, so a corrector at init (h = identity) gives bitwise stale's scores."""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

CPU_TILE_ROWS = 2048  # per-thread tile on CPU: [tile, hidden] activations stay in cache between the GEMMs


def fp32_mm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b accumulated and returned in fp32 whatever the inputs' dtype: on CUDA straight from the
    low-precision inputs (`out_dtype`), elsewhere (no such kernel) by upcasting them."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


class DeviceScorer:
    """out[B, n] = <q, b> (+ <W2^T q, relu(W1 b + c1)> + <q, c2> with a corrector), fp32, a whole chunk per GEMM.

    Unlike the CPU there is no cache to keep the activations in between the two GEMMs, and small tiles
    would leave an accelerator launch-bound: the [chunk, hidden] activations go to one reused buffer."""

    def __init__(self, q, folded, corrector, block_rows: int, fused: bool = False):
        self.q, self.folded, self.corrector = q, folded, corrector
        self.fused = FusedChunk(q, folded, corrector, block_rows) if fused else None
        if corrector is not None and not fused:
            self.hidden_buf = torch.empty(block_rows, corrector.hidden, dtype=q.dtype, device=q.device)

    def __call__(self, block, out) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(block)
        fp32_mm(self.q, block.t(), out=out)
        if self.folded is None:
            return out
        q_hidden, q_bias = self.folded
        out.add_(q_bias.unsqueeze(1))
        activations = self.corrector.hidden_activations(block, out=self.hidden_buf[: block.shape[0]])
        return out.add_(fp32_mm(q_hidden, activations.t()))

    def close(self) -> None:
        pass


class CpuScorer:
    """The same scores on CPU, with the torch threads split over row tiles instead of inside each GEMM.

    Measured on 2 cores: the thin GEMMs (K = dim for the first layer, 128 queries for the second) reach
    ~0.5 of the square-GEMM rate when oneMKL splits each one over 2 threads, but ~0.9 when each thread
    runs whole small tiles single-threaded (docs/search_benchmark.md). Workers write disjoint columns.
    Stale search uses the same tiles, so a corrector at init (h = identity) gives bitwise the same scores.
    """

    def __init__(self, q, folded, corrector, block_rows: int, fused: bool = False):
        self.q, self.folded, self.corrector = q, folded, corrector
        self.threads = torch.get_num_threads()
        tile = min(CPU_TILE_ROWS, block_rows)
        hidden = corrector.hidden if corrector is not None and not fused else 0
        self.tile = tile
        self.buffers = [torch.empty(tile, hidden) for _ in range(self.threads)]
        self.fused = [FusedChunk(q, folded, corrector, tile) for _ in range(self.threads)] if fused else None
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self.inference_mode = torch.is_inference_mode_enabled()  # thread-local: the workers must copy it

    def _score_tiles(self, worker: int, block, out, lo: int, hi: int) -> None:
        if self.pool is None:
            self._score_tile_range(worker, block, out, lo, hi)
            return
        torch.set_num_threads(1)  # this thread's GEMMs stay on its own core
        with torch.inference_mode(self.inference_mode), torch.no_grad():
            self._score_tile_range(worker, block, out, lo, hi)

    def _score_tile_range(self, worker: int, block, out, lo: int, hi: int) -> None:
        for start in range(lo, hi, self.tile):
            tile = block[start: min(hi, start + self.tile)]
            scores = out[:, start: start + tile.shape[0]]
            if self.fused is not None:
                scores.copy_(self.fused[worker](tile))
                continue
            torch.mm(self.q, tile.t(), out=scores)
            if self.folded is not None:
                q_hidden, q_bias = self.folded
                scores.add_(q_bias.unsqueeze(1))
                activations = self.corrector.hidden_activations(tile, out=self.buffers[worker][: tile.shape[0]])
                scores.addmm_(q_hidden, activations.t())

    def __call__(self, block, out) -> torch.Tensor:
        if self.pool is None:
            self._score_tiles(0, block, out, 0, block.shape[0])
            return out
        tiles = -(-block.shape[0] // self.tile)
        bounds = [min(block.shape[0], (tiles * w // self.threads) * self.tile)
                  for w in range(self.threads + 1)]
        jobs = [self.pool.submit(self._score_tiles, w, block, out, bounds[w], bounds[w + 1])
                for w in range(self.threads) if bounds[w] < bounds[w + 1]]
        for job in jobs:
            job.result()
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            torch.set_num_threads(self.threads)  # oneMKL's thread count is process-wide: restore the caller's


def corrector_chunk_scores(block, q, weight, bias, q_hidden, q_bias):
    """<q, b> + <q, c2> + <W2^T q, relu(W1 b + c1)> for a block of rows, in fp32 (the device scorer's sum)."""
    activations = torch.relu(torch.addmm(bias, block, weight.t()))
    return fp32_mm(q, block.t()).add(q_bias.unsqueeze(1)).add(fp32_mm(q_hidden, activations.t()))


@functools.cache
def compiled_chunk_scores(device_type: str):
    """One compiled `corrector_chunk_scores` per device type, kept for the process (a graph per shape and dtype).

    On CUDA max-autotune lets inductor pick Triton GEMM templates whose epilogue takes bias, ReLU and the cast, and
    add the three terms in one pass; without CUDA graphs, whose static inputs would copy every chunk."""
    mode = "max-autotune-no-cudagraphs" if device_type == "cuda" else None
    with warnings.catch_warnings():  # inductor's first import calls torch.jit.script_method, deprecated in torch
        warnings.filterwarnings("ignore", ".*script_method", DeprecationWarning)
        return torch.compile(corrector_chunk_scores, dynamic=False, mode=mode)


class FusedChunk:
    """Corrector-full scores of a block of rows from the compiled `corrector_chunk_scores` (`search(fused=True)`).

    Shapes are static, so a block shorter than `block_rows` (the last chunk or tile) is copied into one reused
    block of `block_rows` rows rather than compiled again; the columns past it are dropped."""

    def __init__(self, q, folded, corrector, block_rows: int):
        weight, bias = corrector.first_layer(q.dtype)
        self.args = (q, weight, bias, *folded)
        self.block_rows = block_rows
        self.padded = None
        self.score = compiled_chunk_scores(q.device.type)

    def __call__(self, block) -> torch.Tensor:
        n = block.shape[0]
        if n < self.block_rows:
            if self.padded is None:
                self.padded = block.new_zeros(self.block_rows, block.shape[1])
            self.padded[:n].copy_(block)
            block = self.padded
        return self.score(block, *self.args)[:, :n]

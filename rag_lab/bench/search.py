"""Buffer search benchmark: prints, from ONE run, every figure docs/search_benchmark.md reports.

1. dense fp32 GEMM peak (large square torch.mm, same thread count) — the yardstick;
2. corrector-full search: rows/s, FLOP/s and the ratio to that peak;
3. exact stale search vs faiss.IndexFlatIP on the same data and threads (time ratio, same top-k);
4. a large fp16 memmapped buffer (written in chunks to a temp file, removed afterwards) searched
   exact + corrector-full, with the peak resident memory sampled during each search.

With `--device cuda` it measures the GPU path instead (a buffer held on the device in `--dtype`):
1. the device's yardsticks: bf16 GEMM peak (8192^3) and device-to-device copy bandwidth;
2. exact search vs the plain one-shot `topk(q @ B^T)` on the same rows (time ratio, same ids), and its
   buffer read rate against the copy bandwidth (exact search is memory-bound);
3. corrector-full search vs the plain version that materialises h(B) chunk by chunk and multiplies
   (time ratio, same ids), and its FLOP/s against the GEMM peak (it is compute-bound);
4. the fused corrector-full search (`search(fused=True)`, compiled chunk function) beside it: time, fraction
   of the same peak, compile time, ids against the unfused search's;
5. peak device memory beyond the buffer during each search.

    python scripts/bench_search.py --device cuda --rows 28000000 --dim 768 --hidden 8192 --batch 64 --k 32 \
        --dtype bf16 --chunk 262144

Timings are the best of `--repeats` runs, so other load on the machine inflates them as little as possible.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from rag_lab.bench.machine import cpu_name, peak_rss_bytes, rss_kib, synchronize
from rag_train.buffer.chunk_scores import fp32_mm
from rag_train.buffer.search import _chunk_topk, search
from rag_train.models.corrector import Corrector

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="in-memory buffer rows")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512, help="corrector hidden units")
    parser.add_argument("--batch", type=int, default=128, help="queries per search")
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=65536, help="search chunk_rows")
    parser.add_argument("--threads", type=int, default=2, help="torch and faiss threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memmap-rows", type=int, default=28_000_000, help="0 skips the memmap part")
    parser.add_argument("--memmap-batch", type=int, default=32, help="queries per memmapped search")
    parser.add_argument("--memmap-dir", default=None, help="where the temporary buffer file goes (default: $TMPDIR)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the on-device buffer benchmark")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="buffer dtype on the device")
    parser.add_argument("--gemm-size", type=int, default=None,
                        help="side of the square GEMM yardstick (default 8192 on CUDA, 2048 on CPU)")
    return parser.parse_args(argv)


CPU_SECONDS = {}  # best process CPU time per timed call, keyed by label: robust to other load on the machine


def best_time(fn, repeats: int, label: str = "", device: torch.device = torch.device("cpu")) -> float:
    """Best wall time of `repeats` calls (the device synchronised around each); the best CPU time (all
    threads) goes to CPU_SECONDS[label]."""
    fn()  # warm-up: allocations, thread pools, page faults
    wall, cpu = [], []
    for _ in range(repeats):
        synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        synchronize(device)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    CPU_SECONDS[label] = min(cpu)
    return min(wall)


def gemm_peak(repeats: int) -> tuple[float, int]:
    """Best fp32 GFLOP/s of square torch.mm over a few sizes."""
    best = (0.0, 0)
    for size in (2048, 3072, 4096):
        a, b = torch.randn(size, size), torch.randn(size, size)
        out = torch.empty(size, size)
        seconds = best_time(lambda: torch.mm(a, b, out=out), repeats, f"gemm{size}")
        best = max(best, (2 * size**3 / seconds / 1e9, size))
    cpu_peak = max(2 * size**3 / CPU_SECONDS[f"gemm{size}"] / 1e9 for size in (2048, 3072, 4096))
    CPU_SECONDS["peak_per_cpu_s"] = cpu_peak
    return best


def corrector_flops_per_row(dim: int, hidden: int, batch: int) -> int:
    """First layer (D x hidden per row) + folded second layer and stale score (B x (hidden + D) per row)."""
    return 2 * dim * hidden + 2 * batch * (hidden + dim)


class RssPeak:
    """Samples VmRSS every 10 ms in a thread: the peak resident memory of one phase of this process."""

    def __enter__(self):
        self.base_kib = self.peak_kib = rss_kib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak_kib = max(self.peak_kib, rss_kib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, rss_kib())

    @property
    def gib(self) -> float:
        return self.peak_kib / 2**20

    @property
    def grown_gib(self) -> float:
        return (self.peak_kib - self.base_kib) / 2**20


def make_corrector(dim: int, hidden: int, seed: int) -> Corrector:
    torch.manual_seed(seed)
    corrector = Corrector(dim, hidden)
    torch.nn.init.normal_(corrector.second.weight, std=0.02)  # a trained-looking, non-identity h
    return corrector


def in_memory_part(args, peak: float) -> None:
    import faiss

    gen = torch.Generator().manual_seed(args.seed)
    rows = torch.randn(args.rows, args.dim, generator=gen)
    queries = torch.randn(args.batch, args.dim, generator=gen)
    corrector = make_corrector(args.dim, args.hidden, args.seed)

    with RssPeak() as rss:
        seconds = best_time(lambda: search(queries, rows, args.k, corrector=corrector, mode="corrector_full",
                                           chunk_rows=args.chunk), args.repeats, "corrector")
    flops = args.rows * corrector_flops_per_row(args.dim, args.hidden, args.batch)
    gflops = flops / seconds / 1e9
    print(f"corrector_full  {args.rows} x {args.dim}, hidden {args.hidden}, {args.batch} queries, k={args.k}: "
          f"{seconds:.3f} s  {args.rows / seconds / 1e6:.2f} M rows/s  {gflops:.1f} GFLOP/s  "
          f"= {gflops / peak:.2f} x GEMM peak  (peak RSS {rss.gib:.2f} GiB, buffer {rows.numel() * 4 / 2**30:.2f} GiB)")
    per_cpu_s = flops / CPU_SECONDS["corrector"] / 1e9
    print(f"  by CPU time   {per_cpu_s:.1f} GFLOP per CPU-second vs GEMM {CPU_SECONDS['peak_per_cpu_s']:.1f}: "
          f"{per_cpu_s / CPU_SECONDS['peak_per_cpu_s']:.2f} x peak (insensitive to other processes' load)")
    fused_s = best_time(lambda: search(queries, rows, args.k, corrector=corrector, mode="corrector_full",
                                       chunk_rows=args.chunk, fused=True), args.repeats, "fused")
    plain = search(queries, rows, args.k, corrector=corrector, mode="corrector_full", chunk_rows=args.chunk)
    fused = search(queries, rows, args.k, corrector=corrector, mode="corrector_full", chunk_rows=args.chunk, fused=True)
    print(f"  fused         {fused_s:.3f} s = {fused_s / seconds:.2f} x unfused; by CPU time "
          f"{CPU_SECONDS['fused'] / CPU_SECONDS['corrector']:.2f} x (same ids {same_ids(fused.rows, plain.rows):.4f}, "
          f"max |score diff| {float((fused.scores - plain.scores).abs().max()):.1e})")

    ours = search(queries, rows, args.k, chunk_rows=args.chunk)
    exact_s = best_time(lambda: search(queries, rows, args.k, chunk_rows=args.chunk), args.repeats, "exact")
    index = faiss.IndexFlatIP(args.dim)
    index.add(rows.numpy())
    query_np = queries.numpy()
    faiss_scores, faiss_ids = index.search(query_np, args.k)
    faiss_s = best_time(lambda: index.search(query_np, args.k), args.repeats, "faiss")
    same = float((ours.rows.numpy() == faiss_ids).mean())
    score_gap = float(np.abs(ours.scores.numpy() - faiss_scores).max())
    print(f"exact           ours {exact_s:.3f} s  faiss.IndexFlatIP {faiss_s:.3f} s  ratio {exact_s / faiss_s:.2f}  "
          f"(same ids {same:.4f}, max |score diff| {score_gap:.1e}); by CPU time "
          f"{CPU_SECONDS['exact']:.3f} vs {CPU_SECONDS['faiss']:.3f} CPU-s, "
          f"ratio {CPU_SECONDS['exact'] / CPU_SECONDS['faiss']:.2f}")
    print(f"peak RSS (process so far) {peak_rss_bytes() / 2**30:.2f} GiB")


def write_random_fp16(path: Path, rows: int, dim: int, seed: int, block: int = 1_000_000) -> None:
    """Stream random fp16 rows to `path` block by block (never the whole buffer in memory)."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as handle:
        for start in range(0, rows, block):
            n = min(block, rows - start)
            handle.write(rng.standard_normal((n, dim), dtype=np.float32).astype(np.float16).tobytes())


def memmap_part(args) -> None:
    directory = args.memmap_dir or tempfile.gettempdir()
    fd, name = tempfile.mkstemp(prefix="bench-buffer-", suffix=".f16", dir=directory)
    os.close(fd)
    path = Path(name)
    try:
        start = time.perf_counter()
        write_random_fp16(path, args.memmap_rows, args.dim, args.seed)
        size_gib = path.stat().st_size / 2**30
        print(f"memmap buffer   {args.memmap_rows} x {args.dim} fp16 = {size_gib:.2f} GiB written in "
              f"{time.perf_counter() - start:.0f} s")
        mapped = np.memmap(path, dtype=np.float16, mode="r", shape=(args.memmap_rows, args.dim))
        queries = torch.randn(args.memmap_batch, args.dim, generator=torch.Generator().manual_seed(args.seed))
        corrector = make_corrector(args.dim, args.hidden, args.seed)
        for mode in ("exact", "corrector_full"):
            with RssPeak() as rss:
                start = time.perf_counter()
                result = search(queries, mapped, args.k, corrector=corrector, mode=mode, chunk_rows=args.chunk)
                seconds = time.perf_counter() - start
            print(f"memmap {mode:<14} {args.memmap_batch} queries: {seconds:.1f} s  "
                  f"{args.memmap_rows / seconds / 1e6:.2f} M rows/s  peak RSS {rss.gib:.2f} GiB = "
                  f"{rss.gib / size_gib:.3f} x buffer size (grew {rss.grown_gib:.3f} GiB during the search); "
                  f"top row of query 0: {int(result.rows[0, 0])}")
        del mapped
    finally:
        path.unlink(missing_ok=True)


def device_yardsticks(device: torch.device, dtype: torch.dtype, repeats: int,
                      size: Optional[int] = None) -> tuple[float, float]:
    """(GEMM TFLOP/s in `dtype` at size^3, by default 8192^3, or 2048^3 on CPU; copy GB/s counting bytes read +
    written)."""
    size = size or (8192 if device.type == "cuda" else 2048)
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    gemm_s = best_time(lambda: torch.mm(a, b), repeats, device=device)
    source = torch.empty(2**30 if device.type == "cuda" else 2**26, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_s = best_time(lambda: target.copy_(source), repeats, device=device)
    return 2 * size**3 / gemm_s / 1e12, 2 * source.numel() / copy_s / 1e9


def random_unit_rows(rows: int, dim: int, dtype: torch.dtype, device: torch.device, seed: int,
                     block: int = 1 << 20) -> torch.Tensor:
    """L2-normalised random rows (like GTR embeddings) built on the device block by block."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(rows, dim, dtype=dtype, device=device)
    for start in range(0, rows, block):
        chunk = torch.randn(min(block, rows - start), dim, device=device, generator=gen)
        out[start: start + chunk.shape[0]] = torch.nn.functional.normalize(chunk, dim=1)
    return out


def plain_exact(queries: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """What one writes first: every score at once, then top-k."""
    return torch.topk(torch.mm(queries.to(rows.dtype), rows.t()).float(), k, dim=1).indices


def plain_corrector(queries, rows, k, corrector, chunk):
    """h(B) materialised chunk by chunk, scored, and a running top-k."""
    best_scores = best_rows = None
    q = queries.to(rows.dtype)
    for start in range(0, rows.shape[0], chunk):
        corrected = corrector(rows[start: start + chunk])
        scores = torch.mm(q, corrected.t()).float()
        values, index = torch.topk(scores, min(k, scores.shape[1]), dim=1)
        index = index + start
        if best_scores is not None:
            values, index = torch.cat([best_scores, values], 1), torch.cat([best_rows, index], 1)
        best_scores, order = torch.topk(values, k, dim=1)
        best_rows = index.gather(1, order)
    return best_rows


def same_ids(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of each query's top-k ids found in the reference's top-k (order-free: ties may reorder)."""
    hits = (ours.unsqueeze(2) == reference.unsqueeze(1)).any(2)
    return float(hits.float().mean())


def peak_beyond(device: torch.device, baseline: int, fn) -> float:
    """GiB allocated on the device beyond `baseline` at the peak of one call (0 on CPU: not tracked)."""
    if device.type != "cuda":
        fn()
        return 0.0
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    return (torch.cuda.max_memory_allocated(device) - baseline) / 2**30


@torch.no_grad()
def corrector_breakdown(queries, rows, corrector, args, device, full_s: float) -> dict[str, float]:
    """Where corrector-full's time goes: each kernel of one chunk timed alone, times the number of chunks
    (seconds per kernel; the unfused ones, for comparison, are not part of the search)."""
    dtype = rows.dtype
    block = rows[: args.chunk]
    chunks = -(-rows.shape[0] // args.chunk)
    weight, bias = corrector.first.weight.to(dtype), corrector.first.bias.to(dtype)
    q = queries.to(dtype)
    q_hidden = (queries @ corrector.second.weight).to(dtype)
    hidden = torch.empty(block.shape[0], args.hidden, dtype=dtype, device=device)
    scores = torch.randn(args.batch, block.shape[0], device=device)  # top-k time depends on the values
    parts = [  # (name, kernel, part of the search's own path)
        ("stale scores q B^T", lambda: fp32_mm(q, block.t()), True),
        ("first layer W1 b + c1", lambda: torch.addmm(bias, block, weight.t(), out=hidden), False),
        ("relu as a separate pass", lambda: hidden.relu_(), False),
        ("first layer + relu fused", lambda: corrector.hidden_activations(block, out=hidden), True),
        ("second layer (W2^T q) a", lambda: fp32_mm(q_hidden, hidden.t()), True),
        ("chunk top-k", lambda: _chunk_topk(scores, args.k), True),
    ]
    total, timed = 0.0, {}
    for name, fn, in_search in parts:
        seconds = best_time(fn, args.repeats, device=device) * chunks
        timed[name] = seconds
        total += seconds if in_search else 0.0
        print(f"  {name:<26} {seconds * 1e3:8.1f} ms over {chunks} chunks ({seconds / full_s:.0%} of the search)"
              f"{'' if in_search else '  [unfused, for comparison]'}")
    print(f"  {'sum of the search parts':<26} {total * 1e3:8.1f} ms; the rest ({(full_s - total) * 1e3:.1f} ms): "
          f"bias add, merges, launches")
    return timed


@torch.no_grad()
def fused_part(fused, unfused_rows, unfused_s: float, unfused_fraction: float, args, device, baseline: int) -> dict:
    """`search(fused=True)` beside the unfused corrector-full search: the first call (compiling the chunk function:
    max-autotune on CUDA) timed alone, then the best of `--repeats`; ids against the unfused search's."""
    synchronize(device)
    start = time.perf_counter()
    first = fused()
    synchronize(device)
    compile_s = time.perf_counter() - start
    seconds = best_time(fused, args.repeats, device=device)
    extra_gib = peak_beyond(device, baseline, fused)
    tflops = args.rows * corrector_flops_per_row(args.dim, args.hidden, args.batch) / seconds / 1e12
    overlap, identical = same_ids(first, unfused_rows), float((first == unfused_rows).float().mean())
    print(f"corrector_fused {seconds * 1e3:.1f} ms = {seconds / unfused_s:.2f} x unfused, {tflops:.1f} TFLOP/s = "
          f"{unfused_fraction * unfused_s / seconds:.2f} x GEMM peak (unfused {unfused_fraction:.2f}); first call "
          f"{compile_s:.1f} s (compiles); same ids as unfused {overlap:.4f}, identical rows {identical:.4f}; extra "
          f"memory {extra_gib:.2f} GiB")
    return {"seconds": seconds, "compile_seconds": compile_s, "tflops": tflops, "same_ids_as_unfused": overlap,
            "identical_rows_as_unfused": identical, "extra_gib": extra_gib, "top_rows_query0": first[0].tolist()}


def device_part(args) -> dict:
    """The buffer on the device: ours against plain torch on the same rows and queries. Returns the printed
    figures, and the top-k rows of query 0 of both searches (for a check against brute force)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"device: {name}, torch {torch.__version__}, buffer {args.rows} x {args.dim} {args.dtype}, "
          f"{args.batch} queries, k={args.k}, corrector hidden {args.hidden}, chunk {args.chunk}")
    tflops, copy_gbs = device_yardsticks(device, dtype, args.repeats, args.gemm_size)
    print(f"yardsticks      GEMM {tflops:.1f} TFLOP/s ({args.dtype}), copy {copy_gbs:.0f} GB/s (read + written)")
    rows = random_unit_rows(args.rows, args.dim, dtype, device, args.seed)
    queries = torch.nn.functional.normalize(
        torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(args.seed + 1)), dim=1).to(device)
    corrector = make_corrector(args.dim, args.hidden, args.seed).to(device)
    buffer_bytes = rows.numel() * rows.element_size()
    synchronize(device)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def ours(mode, fused=False):
        return search(queries, rows, args.k, corrector=corrector, mode=mode, chunk_rows=args.chunk, fused=fused).rows

    exact_s = best_time(lambda: ours("exact"), args.repeats, device=device)
    plain_s = best_time(lambda: plain_exact(queries, rows, args.k), args.repeats, device=device)
    exact_gib = peak_beyond(device, baseline, lambda: ours("exact"))
    plain_gib = peak_beyond(device, baseline, lambda: plain_exact(queries, rows, args.k))
    exact_rows = ours("exact")
    overlap = same_ids(exact_rows, plain_exact(queries, rows, args.k))
    read_gbs = buffer_bytes / exact_s / 1e9
    print(f"exact           ours {exact_s * 1e3:.1f} ms  plain topk(q @ B^T) {plain_s * 1e3:.1f} ms  ratio "
          f"{exact_s / plain_s:.2f}  (same ids {overlap:.4f}); reads the buffer at {read_gbs:.0f} GB/s = "
          f"{2 * read_gbs / copy_gbs:.2f} x copy bandwidth; extra memory ours {exact_gib:.2f} GiB, plain "
          f"{plain_gib:.2f} GiB (buffer {buffer_bytes / 2**30:.2f} GiB)")

    with torch.no_grad():
        full_s = best_time(lambda: ours("corrector_full"), args.repeats, device=device)
        corrector_in_dtype = copy.deepcopy(corrector).to(dtype)
        naive = lambda: plain_corrector(queries, rows, args.k, corrector_in_dtype, args.chunk)  # noqa: E731
        naive_s = best_time(naive, args.repeats, device=device)
        full_gib = peak_beyond(device, baseline, lambda: ours("corrector_full"))
        naive_gib = peak_beyond(device, baseline, naive)
        full_rows = ours("corrector_full")
        full_overlap = same_ids(full_rows, naive())
    tflops_full = args.rows * corrector_flops_per_row(args.dim, args.hidden, args.batch) / full_s / 1e12
    print(f"corrector_full  ours {full_s * 1e3:.1f} ms  plain h(B) chunks {naive_s * 1e3:.1f} ms  ratio "
          f"{full_s / naive_s:.2f}  (same ids {full_overlap:.4f}); {tflops_full:.1f} TFLOP/s = "
          f"{tflops_full / tflops:.2f} x GEMM peak; extra memory ours {full_gib:.2f} GiB, plain {naive_gib:.2f} GiB")
    fused = fused_part(lambda: ours("corrector_full", fused=True), full_rows, full_s, tflops_full / tflops, args,
                       device, baseline)
    breakdown = corrector_breakdown(queries, rows, corrector, args, device, full_s)
    return {"device_name": name, "gemm_tflops": tflops, "copy_gbs": copy_gbs, "buffer_gib": buffer_bytes / 2**30,
            "exact": {"seconds": exact_s, "plain_seconds": plain_s, "same_ids_as_plain": overlap,
                      "read_gbs": read_gbs, "fraction_of_copy_bandwidth": 2 * read_gbs / copy_gbs,
                      "extra_gib": exact_gib, "plain_extra_gib": plain_gib, "top_rows_query0": exact_rows[0].tolist()},
            "corrector_full": {"seconds": full_s, "plain_seconds": naive_s, "same_ids_as_plain": full_overlap,
                               "tflops": tflops_full, "fraction_of_peak": tflops_full / tflops,
                               "extra_gib": full_gib, "plain_extra_gib": naive_gib,
                               "top_rows_query0": full_rows[0].tolist()},
            "corrector_fused": {**fused, "fraction_of_peak": fused["tflops"] / tflops},
            "corrector_breakdown_seconds": breakdown}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device != "cpu":
        device_part(args)
        return
    import faiss

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, threads={args.threads}, torch {torch.__version__}, "
          f"faiss {faiss.__version__}, load average {os.getloadavg()[0]:.2f}")
    peak, size = gemm_peak(args.repeats)
    print(f"GEMM peak       {peak:.1f} GFLOP/s (fp32 torch.mm {size}^3)")
    if args.rows:
        in_memory_part(args, peak)
    if args.memmap_rows:
        memmap_part(args)
    print(f"load average at end {os.getloadavg()[0]:.2f}")

"""Buffer search benchmark: prints, from ONE run, every figure docs/search_benchmark.md reports.

1. dense fp32 GEMM peak (large square torch.mm, same thread count) — the yardstick;
2. corrector-full search: rows/s, FLOP/s and the ratio to that peak;
3. exact stale search vs faiss.IndexFlatIP on the same data and threads (time ratio, same top-k);
4. a large fp16 memmapped buffer (written in chunks to a temp file, removed afterwards) searched
   exact + corrector-full, with the peak resident memory sampled during each search.

Timings are the best of `--repeats` runs, so other load on the machine inflates them as little as possible.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from rag_train.buffer.search import search
from rag_train.models.corrector import Corrector


def parse_args() -> argparse.Namespace:
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
    return parser.parse_args()


CPU_SECONDS = {}  # best process CPU time per timed call, keyed by label: robust to other load on the machine


def best_time(fn, repeats: int, label: str = "") -> float:
    """Best wall time of `repeats` calls; the best CPU time (all threads) goes to CPU_SECONDS[label]."""
    fn()  # warm-up: allocations, thread pools, page faults
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
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
        self.base_kib = self.peak_kib = _rss_kib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak_kib = max(self.peak_kib, _rss_kib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, _rss_kib())

    @property
    def gib(self) -> float:
        return self.peak_kib / 2**20

    @property
    def grown_gib(self) -> float:
        return (self.peak_kib - self.base_kib) / 2**20


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


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
          f"{CPU_SECONDS['exact']:.3f} vs {CPU_SECONDS['faiss']:.3f} CPU-s, ratio {CPU_SECONDS['exact'] / CPU_SECONDS['faiss']:.2f}")
    print(f"peak RSS (process so far) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


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


def main() -> None:
    args = parse_args()
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


if __name__ == "__main__":
    main()

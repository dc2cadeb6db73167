"""Buffer search against brute-force references: every mode, ties, exclusion, Gumbel, memmap input."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rag_train.buffer.distributed import shard_range
from rag_train.buffer.search import _chunk_topk, _scan, build_faiss_index, search
from rag_train.models.corrector import Corrector


def reference(scores: torch.Tensor, k: int, exclude=None):
    """Brute force: order every row by (score desc, row asc), drop excluded rows, keep k."""
    out_rows, out_scores = [], []
    for b, row_scores in enumerate(scores.tolist()):
        banned = set() if exclude is None else set(exclude[b].tolist())
        order = sorted((r for r in range(len(row_scores)) if r not in banned), key=lambda r: (-row_scores[r], r))[:k]
        out_rows.append(order)
        out_scores.append([row_scores[r] for r in order])
    return torch.tensor(out_rows), torch.tensor(out_scores)


def random_corrector(dim, hidden, seed=0, std=0.3, integer=False):
    gen = torch.Generator().manual_seed(seed)
    corrector = Corrector(dim, hidden)
    with torch.no_grad():
        for param in corrector.parameters():
            values = torch.randint(-2, 3, param.shape, generator=gen).float() if integer else \
                torch.randn(param.shape, generator=gen) * std
            param.copy_(values)
    return corrector


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3000, 16, generator=gen), torch.randn(9, 16, generator=gen)


@pytest.mark.parametrize("chunk_rows", [1, 128, 1000, 5000])
@pytest.mark.parametrize("mode", ["exact", "corrector_full", "corrector_rerank"])
def test_modes_match_brute_force(data, mode, chunk_rows):
    rows, queries = data
    if chunk_rows == 1 and mode != "exact":
        rows = rows[:300]
    corrector = random_corrector(16, 32)
    vectors = rows if mode == "exact" else corrector(rows)
    ref_rows, ref_scores = reference(queries @ vectors.T, 10)
    result = search(queries, rows, 10, corrector=corrector, mode=mode, chunk_rows=chunk_rows,
                    candidates=rows.shape[0])
    assert torch.equal(result.rows, ref_rows)
    torch.testing.assert_close(result.scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert result.scores.dtype == torch.float32 and result.rows.dtype == torch.int64


@pytest.mark.parametrize("mode", ["exact", "corrector_full"])
def test_cpu_tile_workers_match_one_thread_under_inference_mode(mode):
    """Several torch threads score row tiles in worker threads: same result as one thread, also when the
    caller is in inference mode (thread-local, like grad mode), and the caller's thread count comes back."""
    gen = torch.Generator().manual_seed(3)
    rows, queries = torch.randn(9000, 16, generator=gen), torch.randn(5, 16, generator=gen)
    corrector = random_corrector(16, 32)  # parameters require grad, as during training
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = search(queries, rows, 10, corrector=corrector, mode=mode, chunk_rows=6000)
        torch.set_num_threads(3)
        with torch.inference_mode():
            inference_rows = rows.clone()
            pooled = search(queries, inference_rows, 10, corrector=corrector, mode=mode, chunk_rows=6000)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert torch.equal(pooled.rows, single.rows)
    assert torch.equal(pooled.scores, single.scores)


@pytest.mark.parametrize("mode", ["exact", "corrector_full", "corrector_rerank"])
@pytest.mark.parametrize("chunk_rows", [7, 64, 10_000])
def test_ties_go_to_lower_row(mode, chunk_rows):
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(-1, 2, (400, 4), generator=gen).float()  # only 81 distinct rows: massive ties
    queries = torch.randint(-1, 2, (6, 4), generator=gen).float()
    corrector = random_corrector(4, 8, seed=2, integer=True)  # integer maths: scores are exact in fp32
    vectors = rows if mode == "exact" else corrector(rows)
    ref_rows, ref_scores = reference(queries @ vectors.T, 25)
    result = search(queries, rows, 25, corrector=corrector, mode=mode, chunk_rows=chunk_rows, candidates=400)
    assert torch.equal(result.rows, ref_rows)
    assert torch.equal(result.scores, ref_scores)


def test_deferred_tie_check_flags_exactly_the_chunks_with_a_tie_at_k():
    """The device path's deferred check (one flag per chunk, no host sync) must see every tie at the k-th
    place, or `_scan` would keep topk's arbitrary order among tied rows."""
    tied = torch.tensor([[5.0, 3.0, 3.0, 1.0], [9.0, 8.0, 7.0, 6.0]])  # query 0: 2nd and 3rd equal
    for k, expected in ((1, False), (2, True), (3, False)):
        flags = []
        values, index = _chunk_topk(tied, k, ties=flags)
        assert len(flags) == 1 and bool(flags[0]) is expected
        assert torch.equal(values, tied.sort(dim=1, descending=True).values[:, :k])


@pytest.mark.parametrize("chunk_rows", [7, 20, 64, 10_000])
def test_deferred_tie_check_gives_the_eager_result(chunk_rows):
    """The accelerator path (tie check deferred, scan redone on a tie) on CPU: with massive ties, and with
    every chunk no wider than k (no flags at all), it returns what the per-chunk fix returns."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(-1, 2, (400, 4), generator=gen).float()
    queries = torch.randint(-1, 2, (6, 4), generator=gen).float()
    for k in (5, 25):
        eager = _scan(queries, rows, k, None, None, None, 0, chunk_rows, defer_ties=False)
        deferred = _scan(queries, rows, k, None, None, None, 0, chunk_rows, defer_ties=True)
        for a, b in zip(eager, deferred):
            assert torch.equal(a, b)
        assert torch.equal(deferred[1], reference(queries @ rows.T, k)[0])


def test_corrector_at_init_reproduces_stale_search(data):
    rows, queries = data
    stale = search(queries, rows, 50, mode="exact", chunk_rows=700)
    corrected = search(queries, rows, 50, corrector=Corrector(16, 64), mode="corrector_full", chunk_rows=700)
    assert torch.equal(stale.rows, corrected.rows) and torch.equal(stale.scores, corrected.scores)


@pytest.mark.parametrize("mode", ["exact", "corrector_full", "corrector_rerank"])
def test_exclude(data, mode):
    rows, queries = data
    corrector = random_corrector(16, 32)
    vectors = rows if mode == "exact" else corrector(rows)
    top_rows, _ = reference(queries @ vectors.T, 3)
    exclude = torch.cat([top_rows, torch.full((9, 2), -1), torch.tensor([[5], [2999]] * 4 + [[0]])], dim=1)
    ref_rows, ref_scores = reference(queries @ vectors.T, 10, exclude)
    result = search(queries, rows, 10, corrector=corrector, mode=mode, chunk_rows=512, exclude=exclude,
                    candidates=3000)
    assert torch.equal(result.rows, ref_rows)
    assert not (result.rows.unsqueeze(2) == top_rows.unsqueeze(1)).any()
    torch.testing.assert_close(result.scores, ref_scores, rtol=1e-5, atol=1e-5)


def test_exclude_leaving_fewer_than_k_rows_is_an_error():
    rows, queries = torch.randn(5, 4), torch.randn(2, 4)
    with pytest.raises(ValueError, match="fewer than k=4"):
        search(queries, rows, 4, exclude=torch.tensor([[0, 1], [-1, -1]]))


def test_gumbel_k1_frequencies_follow_softmax():
    rows = torch.eye(6)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.0])
    temperature = 0.7
    queries = logits.repeat(4000, 1)  # <q, e_i> = logits[i]; 4000 independent draws
    gen = torch.Generator().manual_seed(123)
    result = search(queries, rows, 1, sampling="gumbel", temperature=temperature, generator=gen, chunk_rows=4)
    counts = torch.bincount(result.rows[:, 0], minlength=6).numpy()
    expected = torch.softmax(logits.double() / temperature, 0).numpy() * counts.sum()
    assert chisquare(counts, expected).pvalue > 1e-3
    torch.testing.assert_close(result.scores[:, 0], logits[result.rows[:, 0]])  # raw scores, not keys


def test_gumbel_is_reproducible_distinct_and_chunk_independent(data):
    rows, queries = data
    corrector = random_corrector(16, 32)
    runs = [search(queries, rows, 20, corrector=corrector, mode="corrector_full", sampling="gumbel",
                   generator=torch.Generator().manual_seed(seed), chunk_rows=chunk)
            for seed, chunk in ((7, 333), (7, 3000), (8, 333))]
    assert torch.equal(runs[0].rows, runs[1].rows)
    assert not torch.equal(runs[0].rows, runs[2].rows)
    assert all(len(set(r)) == 20 for r in runs[0].rows.tolist())
    exact = queries @ corrector(rows).T
    torch.testing.assert_close(runs[0].scores, exact.gather(1, runs[0].rows), rtol=1e-5, atol=1e-5)


def test_gumbel_with_tiny_temperature_is_topk(data):
    rows, queries = data
    sampled = search(queries, rows, 5, sampling="gumbel", temperature=1e-6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled.rows, search(queries, rows, 5).rows)



@pytest.mark.parametrize("threads", [1, 2])
def test_fused_scorer_matches_brute_force_and_the_unfused_scan(data, threads):
    """The compiled chunk function (search's `fused`) against h(B) materialised and scored here, and against the
    unfused scan: the same rows, scores equal to rounding (fp32 sums added in another order). A standardizing
    corrector too (its statistics folded into W1, c1), with one or two torch threads (tile workers)."""
    rows, queries = data
    plain_h = random_corrector(16, 32)
    standardizing = Corrector(16, 32, standardize=True)
    standardizing.load_state_dict(plain_h.state_dict(), strict=False)
    standardizing.set_input_statistics(rows.mean(0), rows.std(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for corrector in (plain_h, standardizing):
            ref_rows, ref_scores = reference(queries @ corrector(rows).T, 10)
            fused = search(queries, rows, 10, corrector=corrector, mode="corrector_full", chunk_rows=1000, fused=True)
            unfused = search(queries, rows, 10, corrector=corrector, mode="corrector_full", chunk_rows=1000)
            assert torch.equal(fused.rows, ref_rows) and torch.equal(fused.rows, unfused.rows)
            torch.testing.assert_close(fused.scores, ref_scores, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fused.scores, unfused.scores, rtol=1e-6, atol=1e-6)
    finally:
        torch.set_num_threads(before)


def test_fused_scorer_keeps_ties_exclusions_and_gumbel_samples():
    """Integer maths (exact in fp32), 81 distinct rows in 400, chunks of 64 (the last one, 16 rows, padded): ties go
    to the lower row, excluded rows never come back and Gumbel samples are the unfused scan's, with the per-chunk
    tie check eager or deferred (the accelerator's way)."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(-1, 2, (400, 4), generator=gen).float()
    queries = torch.randint(-1, 2, (6, 4), generator=gen).float()
    corrector = random_corrector(4, 8, seed=2, integer=True)
    scores = queries @ corrector(rows).T
    exclude = torch.cat([reference(scores, 3)[0], torch.full((6, 1), -1), torch.tensor([[399]] * 6)], dim=1)
    for kwargs in ({}, {"exclude": exclude}):
        ref_rows, ref_scores = reference(scores, 25, kwargs.get("exclude"))
        fused = search(queries, rows, 25, corrector=corrector, mode="corrector_full", chunk_rows=64, fused=True,
                       **kwargs)
        assert torch.equal(fused.rows, ref_rows) and torch.equal(fused.scores, ref_scores)
    sampled = [search(queries, rows, 25, corrector=corrector, mode="corrector_full", chunk_rows=64, fused=fused,
                      sampling="gumbel", generator=torch.Generator().manual_seed(5)) for fused in (True, False)]
    assert torch.equal(sampled[0].rows, sampled[1].rows) and torch.equal(sampled[0].scores, sampled[1].scores)
    for k in (5, 25):
        deferred = _scan(queries, rows, k, corrector, None, None, 0, 64, defer_ties=True, fused=True)
        assert torch.equal(deferred[1], reference(scores, k)[0])

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_memmap_matches_tensor(tmp_path, data, dtype):
    rows, queries = data
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        np_dtype, torch_rows = ml_dtypes.bfloat16, rows.to(torch.bfloat16)
    else:
        np_dtype, torch_rows = np.float16, rows.half()
    path = tmp_path / "buffer.bin"
    torch_rows.view(torch.int16).numpy().tofile(path)
    mapped = np.memmap(path, dtype=np_dtype, mode="r", shape=tuple(rows.shape))
    corrector = random_corrector(16, 32)
    for mode in ("exact", "corrector_full"):
        from_file = search(queries, mapped[1000:], 10, corrector=corrector, mode=mode, chunk_rows=300,
                           row_offset=1000)
        from_tensor = search(queries, torch_rows[1000:], 10, corrector=corrector, mode=mode, chunk_rows=300,
                             row_offset=1000)
        assert torch.equal(from_file.rows, from_tensor.rows) and torch.equal(from_file.scores, from_tensor.scores)
        assert from_file.rows.min() >= 1000


def _rss_file_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


def test_memmap_scan_keeps_file_pages_out_of_rss(tmp_path):
    rows = np.random.default_rng(0).standard_normal((400_000, 32), dtype=np.float32).astype(np.float16)
    path = tmp_path / "big.bin"
    rows.tofile(path)
    del rows
    mapped = np.memmap(path, dtype=np.float16, mode="r", shape=(400_000, 32))
    before = _rss_file_kib()
    search(torch.randn(4, 32), mapped, 5, chunk_rows=16384)
    grown_kib = _rss_file_kib() - before
    assert grown_kib < 0.1 * path.stat().st_size / 1024, f"file-backed RSS grew by {grown_kib} KiB"


def test_rerank_equals_full_when_candidates_cover_true_topk(data):
    rows, queries = data
    corrector = random_corrector(16, 32, std=0.05)  # small drift: true top-k sit high in the stale ranking
    full = search(queries, rows, 10, corrector=corrector, mode="corrector_full")
    stale_rank = torch.argsort(torch.argsort(queries @ rows.T, dim=1, descending=True), dim=1)
    needed = int(stale_rank.gather(1, full.rows).max()) + 1
    assert needed < 3000
    index = build_faiss_index(rows, "Flat")
    rerank = search(queries, rows, 10, corrector=corrector, mode="corrector_rerank", faiss_index=index,
                    candidates=needed)
    assert torch.equal(rerank.rows, full.rows)
    torch.testing.assert_close(rerank.scores, full.scores, rtol=1e-5, atol=1e-5)


def test_rerank_with_ivf_factory_scores_returned_rows_exactly(data):
    rows, queries = data
    corrector = random_corrector(16, 32)
    result = search(queries, rows, 10, corrector=corrector, mode="corrector_rerank", faiss_index="IVF16,Flat",
                    candidates=100)
    exact = queries @ corrector(rows).T
    torch.testing.assert_close(result.scores, exact.gather(1, result.rows), rtol=1e-5, atol=1e-5)
    assert (result.scores[:, :-1] >= result.scores[:, 1:]).all()


def test_bad_inputs_fail_early(data):
    rows, queries = data
    with pytest.raises(ValueError, match="mode="):
        search(queries, rows, 3, mode="nearest")
    with pytest.raises(ValueError, match="dim"):
        search(queries[:, :8], rows, 3)
    with pytest.raises(ValueError, match="needs a corrector"):
        search(queries, rows, 3, mode="corrector_full")
    with pytest.raises(ValueError, match="larger than the number of buffer rows"):
        search(queries, rows[:2], 3)
    with pytest.raises(ValueError, match="ntotal"):
        search(queries, rows, 3, mode="corrector_rerank", faiss_index=build_faiss_index(rows[:10]))
    with pytest.raises(ValueError, match="factory"):
        build_faiss_index(rows, "NotAnIndex")
    with pytest.raises(ValueError, match="NaN"):
        search(queries * float("nan"), rows, 3)


def test_shard_range_tiles_rows():
    for rows, world in ((10, 3), (2, 4), (1001, 2)):
        ranges = [shard_range(rows, rank, world) for rank in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1
    with pytest.raises(ValueError):
        shard_range(10, 2, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["exact", "corrector_full", "corrector_rerank"])
def test_cuda_fp16_rows_match_cpu(data, mode):
    """On the GPU rows stay fp16 (fp32 accumulation); the ranking matches the fp32 CPU search."""
    rows, queries = data
    rows = rows.half().float()  # the values both sides see
    corrector = random_corrector(16, 32)
    cpu = search(queries, rows, 10, corrector=corrector, mode=mode, chunk_rows=700, candidates=3000)
    gpu = search(queries.cuda(), rows.half().cuda(), 10, corrector=corrector.cuda(), mode=mode, chunk_rows=700,
                 candidates=3000)
    assert (gpu.rows.cpu() == cpu.rows).float().mean() > 0.95
    torch.testing.assert_close(gpu.scores.cpu(), cpu.scores, rtol=2e-2, atol=2e-2)
    sampled = [search(queries.cuda(), rows.half().cuda(), 10, corrector=corrector.cuda(), mode=mode,
                      sampling="gumbel", generator=torch.Generator().manual_seed(1), chunk_rows=chunk,
                      candidates=3000).rows.cpu() for chunk in (700, 3000)]
    assert torch.equal(sampled[0], sampled[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["exact", "corrector_full"])
def test_cuda_ties_go_to_lower_row(mode):
    """The GPU scan defers its tie check; with massive ties it must still order them by row like the CPU."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(-1, 2, (4000, 4), generator=gen).float()
    queries = torch.randint(-1, 2, (6, 4), generator=gen).float()
    corrector = random_corrector(4, 8, seed=2, integer=True)
    cpu = search(queries, rows, 25, corrector=corrector, mode=mode, chunk_rows=64)
    gpu = search(queries.cuda(), rows.cuda(), 25, corrector=corrector.cuda(), mode=mode, chunk_rows=64)
    assert torch.equal(gpu.rows.cpu(), cpu.rows)
    assert torch.equal(gpu.scores.cpu(), cpu.scores)

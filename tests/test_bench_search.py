"""rag_lab/bench/search.py's device part, run on CPU at toy size: it must agree with its plain references."""

import pytest

from rag_lab.bench import search as bench_search


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_device_part_runs_and_matches_plain_torch(capsys, dtype):
    args = bench_search.parse_args(["--device", "cpu", "--rows", "5000", "--dim", "16", "--hidden", "32",
                                    "--batch", "4", "--k", "5", "--chunk", "1024", "--repeats", "1",
                                    "--dtype", dtype, "--gemm-size", "256"])  # bf16 GEMMs crawl on CPU
    bench_search.device_part(args)
    out = capsys.readouterr().out
    for label in ("yardsticks", "exact", "corrector_full", "first layer + relu fused", "sum of the search parts"):
        assert label in out
    if dtype == "fp32":  # same precision on both sides: the same rows
        assert out.count("same ids 1.0000") == 2


def test_same_ids_is_order_free_and_counts_misses():
    import torch

    ours = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert bench_search.same_ids(ours, torch.tensor([[3, 2, 1], [4, 5, 6]])) == 1.0
    assert bench_search.same_ids(ours, torch.tensor([[1, 2, 9], [7, 8, 9]])) == pytest.approx(2 / 6)

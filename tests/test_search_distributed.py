"""2-process sharded search (gloo, CPU) equals single-process search, on every rank."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_train.buffer.search import search
from rag_train.models.corrector import Corrector

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "exact": dict(k=15, mode="exact", chunk_rows=1500),
    "full": dict(k=15, mode="corrector_full", chunk_rows=2048),
    "gumbel_exact": dict(k=15, mode="exact", sampling="gumbel", temperature=0.5, chunk_rows=999, generator_seed=3),
    "gumbel_full": dict(k=15, mode="corrector_full", sampling="gumbel", temperature=2.0, chunk_rows=4096,
                        generator_seed=4),
    "rerank": dict(k=15, mode="corrector_rerank", candidates=20_001, chunk_rows=3000),
}


def make_data():
    """Deterministic buffer spanning several Gumbel noise blocks, with duplicated rows to force ties."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(-3, 4, (20_001, 6), generator=gen).float()
    queries = torch.randint(-2, 3, (5, 6), generator=gen).float()
    corrector = Corrector(6, 12)
    with torch.no_grad():
        for param in corrector.parameters():
            param.copy_(torch.randint(-1, 2, param.shape, generator=gen).float())
    exclude = torch.tensor([[0, 10_000, -1], [19_999, -1, -1], [5, 6, 7], [-1, -1, -1], [12_345, 1, 2]])
    return rows, queries, corrector, exclude


@pytest.mark.slow
def test_two_process_search_equals_single_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # `--cpu --num_processes 2` starts ONE process in accelerate 1.x (multi-CPU needs mpirun); the
    # multi-process launcher plus PartialState(cpu=True) in the script gives two gloo processes.
    from rag_train.launch import launch_command  # here: tests/dist/search_sharded.py imports this module

    cmd = launch_command(str(ROOT / "tests/dist/search_sharded.py"), str(tmp_path), processes=2)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    per_rank = [np.load(tmp_path / f"rank{rank}.npz") for rank in range(2)]
    rows, queries, corrector, exclude = make_data()
    for name, kwargs in CASES.items():
        kwargs = dict(kwargs)
        if "generator_seed" in kwargs:
            kwargs["generator"] = torch.Generator().manual_seed(kwargs.pop("generator_seed"))
        single = search(queries, rows, corrector=corrector, exclude=exclude, **kwargs)
        for rank, saved in enumerate(per_rank):
            assert np.array_equal(saved[f"{name}.rows"], single.rows.numpy()), (name, rank)
            assert np.array_equal(saved[f"{name}.scores"], single.scores.numpy()), (name, rank)
    exact = search(queries, rows, exclude=exclude, **CASES["exact"])
    for saved in per_rank:
        assert np.array_equal(saved["empty_shard.rows"], exact.rows.numpy())
        assert np.array_equal(saved["empty_shard.scores"], exact.scores.numpy())
    assert all(bool(saved["overlap_refused"]) for saved in per_rank)

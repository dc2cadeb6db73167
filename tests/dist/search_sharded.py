"""Run under `accelerate launch --multi_gpu --num_processes 2` with PartialState(cpu=True) (gloo): each rank searches its own shard of a
deterministic buffer; results are saved per rank for tests/test_search_distributed.py to compare
with a single-process search."""

import sys

import numpy as np
import torch
from accelerate import PartialState

from rag_train.buffer.distributed import shard_range
from rag_train.cli import end_process
from rag_train.buffer.search import search
from tests.test_search_distributed import CASES, make_data


def main(out_dir: str) -> None:
    state = PartialState(cpu=True)
    assert state.num_processes == 2, f"expected 2 processes, got {state.num_processes}"
    rows, queries, corrector, exclude = make_data()
    start, end = shard_range(rows.shape[0], state.process_index, state.num_processes)
    results = {}
    for name, kwargs in CASES.items():
        shard_kwargs = dict(kwargs)
        if "generator_seed" in shard_kwargs:
            # a different seed per rank on purpose: rank 0's draw must be the one used everywhere
            shard_kwargs["generator"] = torch.Generator().manual_seed(shard_kwargs.pop("generator_seed")
                                                                      + 1000 * state.process_index)
        result = search(queries, rows[start:end], corrector=corrector, exclude=exclude, row_offset=start,
                        **shard_kwargs)
        results[f"{name}.rows"], results[f"{name}.scores"] = result.rows.numpy(), result.scores.numpy()
    # uneven split with an empty shard on the last rank: it must still join the gather
    start, end = (0, rows.shape[0]) if state.process_index == 0 else (rows.shape[0], rows.shape[0])
    result = search(queries, rows[start:end], row_offset=start, exclude=exclude, **CASES["exact"])
    results["empty_shard.rows"], results["empty_shard.scores"] = result.rows.numpy(), result.scores.numpy()
    try:  # every rank passing the whole buffer must be refused, not silently double counted
        search(queries, rows, 5)
        results["overlap_refused"] = np.array(False)
    except ValueError as exc:
        results["overlap_refused"] = np.array("do not tile" in str(exc))
    np.savez(f"{out_dir}/rank{state.process_index}.npz", **results)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process(0)  # every rank meets the others, then leaves without interpreter teardown

"""Test helper: scripts/train_rlm.py SIGKILLed at one point of one stage, chosen by the FAULT environment variable.

    FAULT="kill:warm_retriever:K"  after optimizer step K of the retriever warm start (Algorithm 1 inside the RLM)
    FAULT="kill:warm_reader:K"     after optimizer step K of the reader warm start
    FAULT="kill:buffer"            once the first shard (and its sidecar) of the RLM's stale buffer is on disk
    FAULT="kill:step:K"            after optimizer step K of the RLM itself

usage: python rlm_faulty.py --config FILE key=value ...
"""

import os
import sys
from pathlib import Path

import rag_train.train.retriever as retriever
import rag_train.train.rlm as rlm
import rag_train.train.warm_start as warm_start
from kill import die, die_after_first_shard

ROOT = Path(__file__).resolve().parents[2]
fault = os.environ.get("FAULT", "").split(":")


def die_after(function, at: int):
    """`function`, SIGKILLing the process right after its `at`-th call returns."""
    calls = [0]

    def counted(*args, **kwargs):
        out = function(*args, **kwargs)
        calls[0] += 1
        if calls[0] == at:
            die()
        return out

    return counted


if fault[0] != "kill":
    raise SystemExit(f"unknown FAULT {os.environ.get('FAULT')!r}")
where, at = fault[1], int(fault[2]) if len(fault) > 2 else None
if where == "warm_retriever":
    retriever.optimizer_step = die_after(retriever.optimizer_step, at)
elif where == "warm_reader":
    class DyingAdafactor(warm_start.Adafactor):
        steps = 0

        def step(self, closure=None):
            out = super().step(closure)
            DyingAdafactor.steps += 1
            if DyingAdafactor.steps == at:
                die()
            return out

    warm_start.Adafactor = DyingAdafactor
elif where == "buffer":
    die_after_first_shard()
elif where == "step":
    rlm.optimizer_step = die_after(rlm.optimizer_step, at)
else:
    raise SystemExit(f"unknown FAULT {os.environ['FAULT']!r}")

if __name__ == "__main__":
    import runpy

    sys.argv = [str(ROOT / "scripts" / "train_rlm.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")

"""Test helper: scripts/embed_corpus.py as it is, with every encoder batch slowed by EMBED_SLEEP seconds, so that a
test polling the output folder has time to signal the build between two shards; with EMBED_PID_DIR each process
first writes its pid to `rank<RANK>.pid` there (a test can then signal one rank of a launch); with
EMBED_RANK0_END_DELAY rank 0 sleeps that long after putting the usual stop-signal handlers back (a slow end of that
rank: its last writes and its line come after the other ranks' exits unless they wait for it).

usage: python embed_slow.py KEY=VALUE ...   (or under `accelerate launch`)
"""

import os
import runpy
import sys
import time
from pathlib import Path

from rag_train.models.retriever import DualEncoder
from rag_train.preemption import StopSignal

ROOT = Path(__file__).resolve().parents[2]
delay = float(os.environ.get("EMBED_SLEEP", "0"))
encode = DualEncoder.encode_passage_features


def slow_encode(self, features):
    time.sleep(delay)
    return encode(self, features)


DualEncoder.encode_passage_features = slow_encode
end_delay = float(os.environ.get("EMBED_RANK0_END_DELAY", "0"))
restore = StopSignal.restore


def slow_restore(self):
    restore(self)
    time.sleep(end_delay)


if end_delay and os.environ.get("RANK", "0") == "0":
    StopSignal.restore = slow_restore
if os.environ.get("EMBED_PID_DIR"):
    pid_file = Path(os.environ["EMBED_PID_DIR"]) / f"rank{os.environ.get('RANK', '0')}.pid"
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(pid_file.with_suffix(".tmp"), pid_file)  # a reader never sees half a pid
sys.argv[0] = str(ROOT / "scripts" / "embed_corpus.py")
runpy.run_path(sys.argv[0], run_name="__main__")

"""Test helper: scripts/train_retriever.py with one fault injected, chosen by the FAULT environment variable.

    FAULT="kill:buffer"          SIGKILL once the first buffer shard (and its sidecar) is on disk
    FAULT="kill:step:K"          SIGKILL right after optimizer step K
    FAULT="kill:save_state:K"    SIGKILL inside the checkpoint of step K, after accelerate wrote its files
                                 (the folder is still the temporary one: no checksums, not renamed)
    FAULT="kill:after_rename:K"  SIGKILL after the checkpoint of step K was renamed into place, before the
                                 `latest.json` pointer moved
    FAULT="hang:step:K"          sleep forever right after optimizer step K (a hung process; SIGTERM ends it)
    FAULT="signal:step:K:NAME"   send this process signal NAME (TERM, USR1) right after optimizer step K (preemption)
    FAULT="fingerprint"          this process reports another corpus fingerprint (a different corpus file)
    FAULT="override:KEY=VALUE"   this process gets one more config override (a different config)
    FAULT_RANK=R                 inject only on rank R (default: every rank)

usage: [accelerate launch ...] python train_faulty.py --config FILE key=value ...
"""

import os
import signal
import sys
import time
from pathlib import Path

import accelerate

import rag_train.data.corpus as corpus_module
import rag_train.train.run as common
import rag_train.train.retriever as retriever
from kill import die, die_after_first_shard

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

fault = os.environ.get("FAULT", "").split(":")
rank = int(os.environ.get("RANK", "0"))
targeted = os.environ.get("FAULT_RANK") in (None, str(rank))


if targeted and fault[0] == "signal":
    step_once, done = retriever.optimizer_step, [0]

    def step_then_signal(*args, **kwargs):
        stepped = step_once(*args, **kwargs)
        done[0] += 1
        if done[0] == int(fault[2]):
            os.kill(os.getpid(), getattr(signal, f"SIG{fault[3]}"))
        return stepped

    retriever.optimizer_step = step_then_signal
elif targeted and fault[0] in ("kill", "hang"):
    where = fault[1]
    at = int(fault[2]) if len(fault) > 2 else None
    if where == "buffer":
        die_after_first_shard()
    elif where == "step":
        step_once, done = retriever.optimizer_step, [0]

        def step_then_fault(*args, **kwargs):
            stepped = step_once(*args, **kwargs)
            done[0] += 1
            if done[0] == at:
                if fault[0] == "kill":
                    die()
                print(f"rank {rank}: hanging after step {at}", file=sys.stderr, flush=True)
                # hung for good: it never reaches the step boundary where the run's stop-signal handler would act,
                # so the launcher's SIGTERM (sent once the other rank has failed) ends it at once instead of
                # after the launcher's 30 s grace period and a SIGKILL
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                while True:
                    time.sleep(60)
            return stepped

        retriever.optimizer_step = step_then_fault
    elif where == "save_state":
        save_state = accelerate.Accelerator.save_state

        def save_then_die(self, output_dir=None, **kwargs):
            out = save_state(self, output_dir, **kwargs)
            if Path(output_dir).name == f".tmp-step-{at:08d}":
                die()
            return out

        accelerate.Accelerator.save_state = save_then_die
    elif where == "after_rename":
        write_json = common.atomic_write_json

        def die_before_pointer(path, obj):
            if Path(path).name == common.LATEST and obj["step"] == at:
                die()
            write_json(path, obj)

        common.atomic_write_json = die_before_pointer
    else:
        raise SystemExit(f"unknown FAULT {os.environ['FAULT']!r}")
elif targeted and fault[0] == "fingerprint":
    corpus_module.Corpus.fingerprint = property(lambda self: "0" * 64)
elif targeted and fault[0] == "override":
    sys.argv.append(os.environ["FAULT"].split(":", 1)[1])
elif fault[0] not in ("", "kill", "hang", "signal", "fingerprint", "override"):
    raise SystemExit(f"unknown FAULT {os.environ['FAULT']!r}")

if __name__ == "__main__":
    import runpy

    sys.argv = [str(ROOT / "scripts" / "train_retriever.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")

"""Launch the ZeRO-3 resume test's two runs (tests/test_deepspeed.py: stopped at step 2, then resumed) in a loop,
optionally beside a CPU load, and count the launches that end with anything but status 0 (the abort at interpreter
exit was SIGABRT, "terminate called without an active exception", about 1 launch in 12 under load). The command and
count of docs/test_suite.md come from here:

    python tests/probe_zero3_exit.py --pairs 30 --load 1 --out /tmp/zero3-probe

Each failed launch's stderr is kept in OUT/failed-<n>.txt. Core dumps, for a native backtrace with gdb, are the
caller's to enable (`ulimit -c unlimited` and /proc/sys/kernel/core_pattern)."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def burn() -> None:
    """One core of CPU load: the other work a CI machine does beside the test."""
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30, help="stop-and-resume pairs (two launches each)")
    parser.add_argument("--load", type=int, default=1, help="busy-loop processes beside the launches")
    parser.add_argument("--out", required=True, help="folder for the toy world, the runs and failed launches' stderr")
    args = parser.parse_args()

    from rag_train.config import DataConfig
    from rag_train.data.toy_files import ensure_toy_world

    from test_deepspeed import SAME, deepspeed_command
    from test_train_rlm import CONFIG, overrides

    out = Path(args.out)
    toy = out / "toy"
    ensure_toy_world(DataConfig(toy_dir=str(toy), toy_passages=300))
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.load)]
    for process in burners:
        process.start()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    launches = failures = 0
    started = time.time()
    try:
        for pair in range(args.pairs):
            run = out / "run"
            shutil.rmtree(run, ignore_errors=True)
            for extra in ({"steps": 2}, {"train.resume": "true"}):
                steps = extra.pop("steps", 4)
                cmd = deepspeed_command(3, "--config", CONFIG,
                                        *overrides(toy, run, "corrector", steps=steps, **{**SAME, **extra}))
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
                launches += 1
                if proc.returncode != 0:
                    failures += 1
                    (out / f"failed-{launches}.txt").write_text(proc.stdout[-5000:] + proc.stderr)
                print(f"launch {launches}: status {proc.returncode} ({failures} failed, "
                      f"{time.time() - started:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
                if proc.returncode != 0:
                    break  # the resume needs a finished first run
    finally:
        for process in burners:
            process.terminate()
    print(f"{launches} ZeRO-3 launches, {failures} ended with a non-zero status")


if __name__ == "__main__":
    main()

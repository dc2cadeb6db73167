"""Launch one of the DeepSpeed tests' runs (tests/test_deepspeed.py) in a loop, optionally beside a CPU load, and
count the launches that end with anything but status 0 or hang. Two rare faults were measured with it
(docs/test_suite.md):

    python tests/probe_launches.py --launch zero3-resume --count 30 --load 1 --out /tmp/zero3-probe
    python tests/probe_launches.py --launch zero2-guard --count 40 --out /tmp/guard-probe

`zero3-resume`: the ZeRO-3 test's two runs, stopped at step 2 then resumed (a pair per count; the abort at
interpreter exit was SIGABRT, about 1 launch in 12 under load). `zero2-guard`: the ZeRO-2 guard test's run with its
injected faults (a rank waited forever for its token-cache DataLoader worker, 1 launch in 139). A failed launch's
output is kept in OUT/failed-<n>.txt; a launch still running after --timeout seconds has every process of it dumped
with `py-spy dump --native` (when py-spy is installed) into OUT/hang-<n>.txt, then is killed. Core dumps, for a
native backtrace with gdb, are the caller's to enable (`ulimit -c unlimited` and /proc/sys/kernel/core_pattern)."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
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


def process_tree(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for child in children for p in process_tree(int(child))]


def dump_stacks(pid: int, path: Path) -> None:
    """Every process of the launch: its command line and py-spy's Python + native stacks."""
    with path.open("w") as out:
        for process in process_tree(pid):
            try:
                command = Path(f"/proc/{process}/cmdline").read_text().replace("\0", " ")
            except OSError:
                continue
            out.write(f"==== {process} {command[:300]}\n")
            if shutil.which("py-spy"):
                dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(process)], capture_output=True,
                                      text=True)
                out.write(dump.stdout + dump.stderr)


def launches(kind: str, toy: Path, out: Path, count: int):
    """(command, whether it resumes the launch before) of each launch in order."""
    from test_deepspeed import FAULTY, SAME, SCRIPT, deepspeed_command
    from test_train_rlm import CONFIG, overrides

    if kind == "zero3-resume":
        for _ in range(count):
            run = out / "run"
            shutil.rmtree(run, ignore_errors=True)
            for extra in ({"steps": 2}, {"train.resume": "true"}):
                steps = extra.pop("steps", 4)
                yield deepspeed_command(3, "--config", CONFIG, *overrides(toy, run, "corrector", steps=steps,
                                                                          **{**SAME, **extra})), steps == 4
        return
    import test_train_retriever

    script = out / "faulty.py"
    script.write_text(FAULTY)
    for _ in range(count):
        run = out / "run"
        shutil.rmtree(run, ignore_errors=True)
        args = test_train_retriever.overrides(toy, run, "corrector", **{"strategy.corrector.max_loss": 1e6})
        cmd = deepspeed_command(2, "--config", test_train_retriever.CONFIG, *args)
        cmd[cmd.index(str(SCRIPT))] = str(script)
        yield cmd, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launch", choices=("zero3-resume", "zero2-guard"), required=True)
    parser.add_argument("--count", type=int, default=30, help="launches (zero3-resume: stop-and-resume pairs)")
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes beside the launches")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds after which a launch counts as hung")
    parser.add_argument("--out", required=True, help="folder for the toy world, the runs and failed launches' output")
    args = parser.parse_args()

    from rag_train.config import DataConfig
    from rag_train.data.toy_files import ensure_toy_world

    out = Path(args.out)
    toy = out / "toy"
    ensure_toy_world(DataConfig(toy_dir=str(toy), toy_passages=300))
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.load)]
    for process in burners:
        process.start()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    done = failures = 0
    started = time.time()
    try:
        status = 0
        for cmd, resumes in launches(args.launch, toy, out, args.count):
            if resumes and status != 0:
                continue  # the resume needs a finished first run
            done += 1
            log = out / f"launch-{done}.txt"
            with log.open("w") as output:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                try:
                    status = proc.wait(args.timeout)
                except subprocess.TimeoutExpired:
                    dump_stacks(proc.pid, out / f"hang-{done}.txt")
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    status = "hung"
            if status != 0:
                failures += 1
                log.rename(out / f"failed-{done}.txt")
            else:
                log.unlink()
            print(f"launch {done}: status {status} ({failures} failed, {time.time() - started:.0f} s, "
                  f"load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for process in burners:
            process.terminate()
    print(f"{done} {args.launch} launches, {failures} failed or hung")


if __name__ == "__main__":
    main()

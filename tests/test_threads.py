"""A CPU run uses the cores it is given: `accelerate launch` exports OMP_NUM_THREADS=1 unless asked
otherwise, and the run's setup replaces that default with the available cores shared out between the processes on
the machine, but keeps a count the user asked for (OMP_NUM_THREADS, the launcher's flag, `train.cpu_threads`).
Real processes, counted against the test's own affinity mask."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rag_train.config import ConfigError, load_config
from rag_train.launch import launch_command, run_script
from rag_train.train.schema import RLMConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist" / "threads.py"
CORES = len(os.sched_getaffinity(0))  # the children inherit this mask


def threads_of(cmd: list[str], omp: str | None = None) -> list[int]:
    """torch threads of each process `cmd` starts, by rank; `omp`: OMP_NUM_THREADS in the launcher's environment."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # every process's record wherever it landed: under a loaded launch another process's output once shared its line
    lines = [json.loads(match) for match in re.findall(r'\{"rank": \d+, "threads": \d+\}', proc.stdout)]
    return [entry["threads"] for entry in sorted(lines, key=lambda entry: entry["rank"])]


@pytest.mark.skipif(CORES < 2, reason="one available core: every rule gives one thread")
def test_one_process_takes_every_core_unless_a_count_was_asked_for():
    assert threads_of(launch_command(SCRIPT, "auto")) == [CORES]  # the launcher's injected OMP_NUM_THREADS=1
    assert threads_of(launch_command(SCRIPT, "auto"), omp="1") == [1]  # the user's OMP_NUM_THREADS
    assert threads_of(launch_command(SCRIPT, "auto", threads=1)) == [1]  # --num_cpu_threads_per_process 1
    assert threads_of(launch_command(SCRIPT, "3"), omp="1") == [3]  # train.cpu_threads wins over both
    assert threads_of([sys.executable, str(SCRIPT), "auto"], omp="1") == [1]  # no launcher: the variable is the user's


@pytest.mark.slow
def test_processes_on_one_machine_share_the_cores():
    assert threads_of(launch_command(SCRIPT, "auto", processes=2)) == [max(1, CORES // 2)] * 2


def test_cpu_threads_is_auto_or_a_positive_count():
    assert load_config(RLMConfig, None, ["train.cpu_threads=4"]).train.cpu_threads == "4"
    for bad in ("0", "-1", "two"):
        with pytest.raises(ConfigError, match="train.cpu_threads"):
            load_config(RLMConfig, None, [f"train.cpu_threads={bad}"])


SCRIPT_AS_RUN = """import json, os, sys
import torch
from pathlib import Path
Path("seen.json").write_text(json.dumps({"argv": sys.argv, "x": os.environ.get("X"), "path0": sys.path[0],
                                         "name": __name__, "threads": torch.get_num_threads()}))
if sys.argv[1] == "raise":
    raise RuntimeError("boom")
sys.exit(int(sys.argv[1]))
"""


# every exit x OMP_NUM_THREADS with the fork server; its fallback (a plain subprocess) with an exit status and an
# exception, with and without the variable
@pytest.mark.parametrize("how, omp, server", [(how, omp, True) for how in ("3", "0", "raise") for omp in (None, "1")]
                         + [("3", None, False), ("raise", "1", False)])
def test_a_forked_run_is_the_script_as_a_fresh_interpreter_runs_it(tmp_path, monkeypatch, omp, how, server):
    """`run_script` (the fork server behind the comparison drivers' single-process runs; without one, as on
    Windows, a fresh interpreter) against `python SCRIPT`: the same exit status (sys.exit(n); an uncaught exception
    1), argv, environment, sys.path[0], __name__ and torch threads, with and without OMP_NUM_THREADS."""
    if not server:
        import multiprocessing

        monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    script = tmp_path / "bin" / "run.py"
    script.parent.mkdir()
    script.write_text(SCRIPT_AS_RUN)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"X": "y", "PYTHONPATH": str(ROOT), **({"OMP_NUM_THREADS": omp} if omp else {})})
    fresh = subprocess.run([sys.executable, str(script), how, "a b"], cwd=tmp_path, env=env, capture_output=True)
    expected = json.loads((tmp_path / "seen.json").read_text())
    (tmp_path / "seen.json").unlink()
    monkeypatch.chdir(tmp_path)
    assert run_script(script, [how, "a b"], env) == fresh.returncode == (1 if how == "raise" else int(how))
    assert json.loads((tmp_path / "seen.json").read_text()) == expected
    assert expected["x"] == "y" and expected["threads"] == (int(omp) if omp else CORES)

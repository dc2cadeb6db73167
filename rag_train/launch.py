"""The one way this package creates an Accelerator, so that every entry point behaves the same under
`accelerate launch`: on a machine without a GPU a multi-process launch (accelerate's torchrun launcher,
`--multi_gpu --num_processes N` or configs/accelerate/cpu_2proc.yaml) becomes a gloo CPU group.

Every collective of the process group has a timeout (`train.collective_timeout` / `collective_timeout`
seconds, 30 minutes by default): a process that hangs makes the others fail with a timeout error instead of
waiting forever, and the launcher then stops the run. A process that dies is noticed sooner: the launcher
stops the others at once.

Under a DeepSpeed launch (`--config_file configs/accelerate/deepspeed_zero{2,3}.yaml`) on a machine without a
GPU the processes also form a gloo group: accelerate 1.x only starts DeepSpeed with `cpu=False` and a named
backend there, and DeepSpeed's CPU accelerator falls back to gloo when oneCCL is absent. That is how the
tests run ZeRO-2 / ZeRO-3 on CPU.

Threads: `accelerate launch` puts OMP_NUM_THREADS into the environment of every process it starts, 1 unless the
user set OMP_NUM_THREADS or `--num_cpu_threads_per_process` (with `--cpu`, physical cores / processes when that is
more than 1), so torch would usually compute on one core. A CPU process therefore sets torch's intra-op threads itself
(`cpu_threads`, i.e. `train.cpu_threads`): `auto` gives each process its share of the cores it may run on
(`os.sched_getaffinity`) divided by the processes on this machine, unless the user asked for a count through
OMP_NUM_THREADS or the launcher's flag; a number is taken as asked. GPU processes keep the launcher's setting."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

DEFAULT_COLLECTIVE_TIMEOUT_S = 1800


def deepspeed_launch() -> bool:
    """True inside `accelerate launch` with a DeepSpeed config (accelerate's launcher sets this variable)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask, which `taskset` and container cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def launcher_default_threads() -> bool:
    """True when OMP_NUM_THREADS is `accelerate launch`'s default rather than a request: the launcher (this
    process's parent, also under its torchrun launcher) had no OMP_NUM_THREADS in its own environment and no
    `--num_cpu_threads_per_process` on its command line. False where that cannot be read: the value counts as asked."""
    if "OMP_NUM_THREADS" not in os.environ or "ACCELERATE_DYNAMO_BACKEND" not in os.environ:  # not from the launcher
        return False
    parent = Path("/proc") / str(os.getppid())
    try:
        environ = (parent / "environ").read_bytes().split(b"\0")
        argv = (parent / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if b"launch" not in argv or not any(b"accelerate" in arg for arg in argv):
        return False
    return not (any(item.startswith(b"OMP_NUM_THREADS=") for item in environ)
                or any(arg.startswith(b"--num_cpu_threads_per_process") for arg in argv))


def cpu_threads(setting: str | int, local_processes: int) -> Optional[int]:
    """torch threads for each of `local_processes` CPU processes on this machine: `setting` if a number; for
    `auto` the available cores shared out (at least one each), or None (leave torch as it is) when the user set
    OMP_NUM_THREADS or the launcher's thread flag."""
    if str(setting) != "auto":
        return int(setting)
    if "OMP_NUM_THREADS" in os.environ and not launcher_default_threads():
        return None
    return max(1, available_cores() // max(1, local_processes))


def make_accelerator(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, find_unused_parameters: bool = False,
                     threads: str | int = "auto", **kwargs) -> Accelerator:
    """An Accelerator (gloo on CPU-only multi-process launches) whose collectives time out after `timeout_s`.
    The timeout is fixed when the process group is created: the first Accelerator of a process decides.

    `find_unused_parameters`: DDP tolerates parameters that get no gradient in a step (the RLM's retriever
    before its gate opens); DDP leaves their gradients at None, so the optimizer skips them as on one process.
    `threads`: torch threads of a CPU process (`cpu_threads`; `train.cpu_threads` in the recipes)."""
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    no_gpu = not torch.cuda.is_available()
    deepspeed = deepspeed_launch()
    kwargs.setdefault("cpu", multi_process and no_gpu and not deepspeed)
    init = {"backend": "gloo"} if deepspeed and no_gpu else {}
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s), **init)]
    if find_unused_parameters:
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    kwargs.setdefault("kwargs_handlers", handlers)
    accelerator = Accelerator(**kwargs)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and not plugin.zero3_init_flag:
        # accelerate points transformers at the DeepSpeed config even with zero3_init_flag false, and under
        # ZeRO-3 transformers then builds every model already partitioned (zero.Init). The recipes build,
        # warm-start and embed with their models before preparing them: they must be whole until then.
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    if accelerator.device.type == "cpu":
        count = cpu_threads(threads, int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
        if count is not None and count != torch.get_num_threads():
            accelerator.print(f"torch threads per process: {count} (was {torch.get_num_threads()}; "
                              f"cpu_threads={threads}, {available_cores()} cores available)")
            torch.set_num_threads(count)
    return accelerator


def launch_command(script: str | Path, *args: object, processes: int = 1, threads: Optional[int] = None) -> list[str]:
    """`accelerate launch SCRIPT ARGS...` (this interpreter) on CPU: one process with `--cpu`, or N > 1 processes
    as a gloo group (`--multi_gpu --num_processes N`, which `make_accelerator` turns into a CPU group on a machine
    without a GPU: `--cpu --num_processes N` starts ONE process in accelerate 1.x) on a free port, so that
    back-to-back launches do not collide. `threads`: torch threads per process (default: accelerate's choice)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes)]
    if processes == 1:
        cmd.append("--cpu")
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd += ["--multi_gpu", "--num_machines", "1", "--main_process_port", str(port)]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    if threads is not None:
        cmd += ["--num_cpu_threads_per_process", str(threads)]
    return cmd + [str(script), *map(str, args)]


# modules a run imports: loaded once by the fork server, so that a forked run starts in a fraction of a second
# instead of spending ~5 s of CPU importing torch and transformers (and 1.5 s more on sentence-transformers, which
# the recipes import when they build a retriever), nor ~0.3 s on the modules the recipes import where they are used
RUN_PRELOAD = ["torch", "accelerate", "transformers.models.t5.modeling_t5", "sentence_transformers", "rag_train.cli",
               "rag_train.train.retriever", "rag_train.train.rlm", "rag_train.train.generative",
               "rag_train.train.summary", "rag_train.train.run_corpus", "rag_train.serving.export",
               "rag_train.data.toy_files", "pytrec_eval"]


def run_preload() -> list[str]:
    """RUN_PRELOAD, and DeepSpeed where it is installed and torch was built without CUDA: accelerate imports it in
    every run that unwraps a model (0.5 s of CPU a run). Its import asks torch.cuda, which on a GPU machine must not
    happen before a fork; a CPU-only torch has no CUDA to ask."""
    cpu_only = not torch.backends.cuda.is_built() and torch.version.hip is None
    return RUN_PRELOAD + (["deepspeed"] if cpu_only and importlib.util.find_spec("deepspeed") else [])


def run_script(script: str | Path, args: list[str], env: dict[str, str]) -> int:
    """`python SCRIPT ARGS...` with environment `env` and this process's working directory, run as a process forked
    from a fork server (multiprocessing's forkserver) that imported `run_preload()` once and computed nothing (forking
    after torch has computed can hang); returns its exit status (a script's `sys.exit(n)` gives n, an uncaught
    exception 1 with its traceback on stderr). Output goes where this process's was when the server started.
    Where there is no fork server (Windows), a fresh interpreter."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return subprocess.run([sys.executable, str(script), *map(str, args)], env=env).returncode
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(run_preload())
    process = context.Process(target=_run_as_main, name=Path(script).name,
                              args=(str(script), [str(a) for a in args], dict(env), os.getcwd()))
    process.start()
    process.join()
    return process.exitcode


def _run_as_main(script: str, args: list[str], env: dict[str, str], cwd: str) -> None:
    """The forked run: the caller's environment and folder, argv and sys.path as `python SCRIPT` sets them."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # the server's OpenMP read the server's environment at import: the count a fresh interpreter would take
    asked = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(asked) if asked.isdigit() and int(asked) > 0 else available_cores())
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")

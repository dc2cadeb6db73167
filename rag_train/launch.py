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
tests run ZeRO-2 / ZeRO-3 on CPU."""

from __future__ import annotations

import os
import socket
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


def make_accelerator(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, find_unused_parameters: bool = False,
                     **kwargs) -> Accelerator:
    """An Accelerator (gloo on CPU-only multi-process launches) whose collectives time out after `timeout_s`.
    The timeout is fixed when the process group is created: the first Accelerator of a process decides.

    `find_unused_parameters`: DDP tolerates parameters that get no gradient in a step (the RLM's retriever
    before its gate opens); DDP leaves their gradients at None, so the optimizer skips them as on one process."""
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

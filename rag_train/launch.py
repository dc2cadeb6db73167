"""The one way this package creates an Accelerator, so that every entry point behaves the same under
`accelerate launch`: on a machine without a GPU a multi-process launch (accelerate's torchrun launcher,
`--multi_gpu --num_processes N` or configs/accelerate/cpu_2proc.yaml) becomes a gloo CPU group.

Every collective of the process group has a timeout (`train.collective_timeout` / `collective_timeout`
seconds, 30 minutes by default): a process that hangs makes the others fail with a timeout error instead of
waiting forever, and the launcher then stops the run. A process that dies is noticed sooner: the launcher
stops the others at once."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

DEFAULT_COLLECTIVE_TIMEOUT_S = 1800


def make_accelerator(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, **kwargs) -> Accelerator:
    """An Accelerator (gloo on CPU-only multi-process launches) whose collectives time out after `timeout_s`.
    The timeout is fixed when the process group is created: the first Accelerator of a process decides."""
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    kwargs.setdefault("cpu", multi_process and not torch.cuda.is_available())
    kwargs.setdefault("kwargs_handlers", [InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))])
    return Accelerator(**kwargs)

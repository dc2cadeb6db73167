"""The one way this package creates an Accelerator, so that every entry point behaves the same under
`accelerate launch`: on a machine without a GPU a multi-process launch (accelerate's torchrun launcher,
`--multi_gpu --num_processes N` or configs/accelerate/cpu_2proc.yaml) becomes a gloo CPU group."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a process that dies or hangs stops the run instead of a silent hang


def make_accelerator(**kwargs) -> Accelerator:
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    kwargs.setdefault("cpu", multi_process and not torch.cuda.is_available())
    kwargs.setdefault("kwargs_handlers", [InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT)])
    return Accelerator(**kwargs)

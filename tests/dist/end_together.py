"""Test helper: a recipe (`rag_train.cli.run_recipe`) whose every process raises the same input error after one
collective that told them all, rank 0 five seconds after the others (a slower end: its last writes); with
EVERY_PROCESS=1 the error is marked `raised_by_every_process`. Each process prints `[rank R] error: ...`.

usage: accelerate launch --num_processes 2 end_together.py
"""

import dataclasses
import os
import time

from rag_train.cli import run_recipe
from rag_train.config import ConfigError
from rag_train.launch import make_accelerator
from rag_train.preemption import raised_by_every_process


@dataclasses.dataclass
class NoConfig:
    """No keys."""


def fail_together(cfg: NoConfig) -> dict:
    accelerator = make_accelerator(timeout_s=60)
    accelerator.wait_for_everyone()  # the collective after which every process knows
    if accelerator.is_main_process:
        time.sleep(5)
    error = ConfigError("every process refuses the same input")
    raise raised_by_every_process(error) if os.environ.get("EVERY_PROCESS") == "1" else error


if __name__ == "__main__":
    run_recipe(NoConfig, None, fail_together, lambda cfg, result: None)

"""What every stage shares: the `Stage` declaration and its `register`, the exit statuses, the errors, the stage
context, the environment record and the same-run GEMM peak every fraction is of."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from rag_train.io import CheckError
from rag_train.plugins import Registry

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[3]
CHECK_FAILED_EXIT = 1  # a stage's own check failed (its results disagree with their reference), or pip failed
INPUT_FAULT_EXIT = 2  # bad arguments: unknown stage, --device cuda without a GPU, cpu without --quick, no fragments


class ReportError(Exception):
    """Bad input to the report command: one line, exit status INPUT_FAULT_EXIT."""


class StageCheckError(CheckError):
    """A stage's results disagree with their own reference (exit status CHECK_FAILED_EXIT): no figures."""


@dataclass
class Context:
    device: "torch.device"
    quick: bool
    work: Path  # scratch space of this stage: <--work>/<stage>, or a temporary folder removed afterwards
    scale_rows: Optional[int] = None


@dataclass(frozen=True)
class Stage:
    """One stage of the report, declared by its module (`<name>_stage.py`) with `register`."""

    name: str  # the value of --stage, and the fragments' file names (<name>.json / .md)
    order: int  # where it runs and appears among the stages (the smallest first)
    minutes: float  # expected on one H100, all included
    what: str  # the fragment's heading and its line in --stage list
    run: Callable[[Context], dict]  # the record's figures (settings, results, goals, the GEMM peak)
    render: Callable[[dict], list]  # the fragment's lines below its heading, from the record
    scales: str  # how its time and memory grow with its sizes (--stage list)


REGISTRY = Registry("gpu_report stage")  # filled by the *_stage.py modules; `stages.STAGES` imports them all


def register(stage: Stage) -> Stage:
    """Add a stage to the report (a `*_stage.py` module calls it at import); TypeError for a duplicate name."""
    return REGISTRY.add(stage.name, stage, stage.run.__module__)


def driver_version() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment(device) -> dict:
    import accelerate
    import sentence_transformers
    import torch
    import transformers

    from rag_lab.bench.machine import cpu_name

    env = {"device": device.type, "cpu": cpu_name(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "sentence_transformers": sentence_transformers.__version__, "accelerate": accelerate.__version__,
           "load_average": round(os.getloadavg()[0], 2)}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, driver=driver_version())
    return env


def gemm_peak(device) -> tuple[float, str]:
    """The same-run yardstick every fraction of a stage is of: FLOP/s of a large square matmul in the dtype the
    models run in (rag_lab/bench/embed.py's)."""
    from rag_lab.bench.embed import gemm_peak as measure

    return measure(device), ("bf16 8192^3 torch.mm" if device.type == "cuda" else "fp32 1024^3 torch.mm")


def fraction_goal(text: str, value: Optional[float], threshold: float, device) -> dict:
    met = None if value is None or device.type != "cuda" else bool(value >= threshold)
    return {"goal": text, "value": value, "met": met}


# --- embed and forward -------------------------------------------------------------------------------------


TOY_PASSAGES = {False: 2000, True: 300}  # the toy world whose passages are glued into long ones (by --quick)

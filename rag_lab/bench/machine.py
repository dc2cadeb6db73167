"""What the benchmarks say about the machine they ran on, and how they wait for it."""

from __future__ import annotations

import platform
import resource
import subprocess

import torch


def cpu_name() -> str:
    """The CPU's model name (lscpu), or what `platform` knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def rss_kib() -> int:
    """This process's resident memory now (KiB)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so wall-clock timings cover it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

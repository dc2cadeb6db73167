"""Peak memory of a training step, and an explicit cap on CUDA, so users can pick N_local and K (seed 002's
question: what fits on an 11 / 24 / 80 GB card)."""

from __future__ import annotations

from pathlib import Path

import torch


class PeakMemory:
    """`reset()` before a step, `peak_mib()` after it: CUDA's max allocated bytes on `device`, else the process's
    peak resident set (VmHWM), reset per step through /proc/self/clear_refs where the kernel allows it (without
    it, the peak since the process started). `fraction` > 0 caps CUDA memory
    (`torch.cuda.set_per_process_memory_fraction`): a step that needs more fails with an out-of-memory error."""

    def __init__(self, device: torch.device, fraction: float = 0.0):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda and fraction > 0:
            torch.cuda.set_per_process_memory_fraction(fraction, device)
        self.per_step = True

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            self.per_step = False

    def peak_mib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

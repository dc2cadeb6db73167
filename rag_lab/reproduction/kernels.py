"""The CPU kernels the reproduction's runs use, pinned before torch loads.

ATen picks its vectorised kernels (AVX2, AVX-512) from the CPU, and they round differently: the same LM recipe built
with AVX-512 kernels gives other weights than with AVX2 ones (docs/corrector_regime.md measured it), so runs made on
two hosts are no pairs. The committed evidence was made with AVX2 kernels; pinning them on every x86 host that has
them lets a rerun give the same bits. An ATEN_CPU_CAPABILITY the caller set is kept. Torch-free on purpose: it has to
run before anything imports torch."""

from __future__ import annotations

import platform
from collections.abc import MutableMapping
from pathlib import Path

VARIABLE = "ATEN_CPU_CAPABILITY"
PINNED = "avx2"


def cpu_flags(cpuinfo: str) -> set[str]:
    """The `flags` of /proc/cpuinfo's first processor."""
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def pin_cpu_kernels(environ: MutableMapping[str, str], machine: str | None = None,
                    cpuinfo: str | None = None) -> str | None:
    """Sets ATEN_CPU_CAPABILITY=avx2 in `environ` (and so in every run launched with it) on an x86-64 Linux host
    whose CPU has AVX2, unless it is set already; returns the value in force (None: torch picks)."""
    if VARIABLE in environ:
        return environ[VARIABLE]
    machine = machine if machine is not None else platform.machine()
    if machine.lower() not in ("x86_64", "amd64"):
        return None
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    if "avx2" not in cpu_flags(cpuinfo):
        return None
    environ[VARIABLE] = PINNED
    return PINNED

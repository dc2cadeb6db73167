"""The wheels a bare GPU image lacks: downloaded where the package index is reachable (`--wheels DIR`), installed
on the GPU machine before a stage imports what needs them."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

# The GPU machines' image ('cuda', as the device tool's docs list it): the Python it runs and the packages it
# holds that the project's stages import. The stages' other needs come as wheels (`--wheels`).
GPU_PYTHON = "3.12"
GPU_IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# what the stages import that the image lacks: omegaconf (config), ir-measures (eval metrics, imported by the
# recipe), faiss-cpu (the buffer's candidate-then-rerank search and the FAISS export; GPU search is torch's own).
# Not carried: datasets, evaluate, fastapi, uvicorn, deepspeed (no stage imports them; tests/test_gpu_report.py
# runs every stage with them hidden).
STAGE_WHEELS = ("faiss-cpu", "omegaconf", "ir-measures")
PIP_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64")


class WheelError(Exception):
    """pip could not download or install the wheels (exit status CHECK_FAILED_EXIT)."""


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_requirements(requires: Callable[[str], Optional[list]] = importlib.metadata.requires,
                       version: Callable[[str], str] = importlib.metadata.version) -> list[str]:
    """`name==version` of STAGE_WHEELS and of everything they need (recursively) that the GPU image lacks, at the
    versions installed here (unpinned where not installed). Requirements behind an extra are skipped; other
    markers are judged for the GPU machine's Python."""
    from packaging.requirements import Requirement

    environment = {"python_version": GPU_PYTHON, "python_full_version": GPU_PYTHON + ".0", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                   "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    wanted, queue = {}, list(STAGE_WHEELS)
    while queue:
        name = normalise(queue.pop(0))
        if name in wanted or name in GPU_IMAGE:
            continue
        try:
            wanted[name] = f"{name}=={version(name)}"
            needs = requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            wanted[name], needs = name, []
        for line in needs:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(environment):
                queue.append(req.name)
    return sorted(wanted.values())


def download_wheels(directory: Path) -> list[Path]:
    """pip-download the wheels of `wheel_requirements()` for the GPU machine (x86-64 Linux, CPython GPU_PYTHON)."""
    directory.mkdir(parents=True, exist_ok=True)
    specs = wheel_requirements()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               GPU_PYTHON, "--implementation", "cp", *[x for p in PIP_PLATFORMS for x in ("--platform", p)],
               "-d", str(directory), *specs]
    print(" ".join(command), flush=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise WheelError(f"pip download failed ({proc.returncode}): {tail[0]}")
    wheels = sorted(directory.glob("*.whl"))
    print(f"{len(wheels)} wheels in {directory} ({sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB): "
          + ", ".join(w.name for w in wheels))
    return wheels


def install_wheels(directory: Path, target: Path) -> list[str]:
    """Install the wheels of `directory` whose distribution is not installed into `target`, and put `target` first
    on this process's path (and its children's). Returns the distributions installed; none without the folder."""
    wheels = sorted(directory.glob("*.whl")) if directory.is_dir() else []
    missing = []
    for wheel in wheels:
        name = normalise(wheel.name.split("-")[0])
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(wheel)
    if not missing:
        return []
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, missing)],
                          capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise WheelError(f"pip install from {directory} failed ({proc.returncode}): {tail[0]}")
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()
    return [normalise(w.name.split("-")[0]) for w in missing]

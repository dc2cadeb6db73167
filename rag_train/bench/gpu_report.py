"""Every GPU figure from one command (scripts/gpu_report.py; docs/gpu_report.md), in stages sized for a short lease
on a bare GPU machine: each stage builds what it needs from scratch (toy world, buffer, models), finishes within
about 8 minutes on one H100, and writes `<stage>.json` and `<stage>.md` under `--out`; `--assemble` turns whatever
fragments exist into docs/gpu_report.md. A stage times the code users run, through the existing benchmarks:

  embed   `buffer/embed.py::embed_rows` vs `SentenceTransformer.encode` (rag_train/bench/embed.py), tiny / small /
          base-shaped towers at 64 / 128 / 256 tokens, plus a host-side profile of `embed_rows`;
  search  exact and corrector-full search of a 28M x 768 bf16 buffer held on the device (rag_train/bench/search.py);
  step    `RLMRecipe.train_step` at base size, 1 and 4 questions (rag_train/bench/rlm_step.py);
  scale   the main job (`train_rlm`) end to end on a >= 5M-passage toy world (rag_train/bench/scale.py).

`--device cpu --quick` runs every stage at toy size (tests/test_gpu_report.py), so the report cannot rot.
A bare GPU image lacks some of the project's imports: `--wheels DIR` downloads them where the package index is
reachable, and every stage first installs the ones missing from DIR (default `.whl/`) if it is there.

Long file: each stage's sizes, check and table sit together so a stage reads in one place, and the report
must run on a bare GPU image from this one entry.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from rag_train.io import CheckError

ROOT = Path(__file__).resolve().parents[2]
CHECK_FAILED_EXIT = 1  # a stage's own check failed (its results disagree with their reference), or pip failed
INPUT_FAULT_EXIT = 2  # bad arguments: unknown stage, --device cuda without a GPU, cpu without --quick, no fragments

# The GPU machines' image ('cuda', docs of the device tool, read 2026-11-17): the Python it runs and the packages it
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


class ReportError(Exception):
    """Bad input to the report command: one line, exit status INPUT_FAULT_EXIT."""


class StageCheckError(CheckError):
    """A stage's results disagree with their own reference (exit status CHECK_FAILED_EXIT): no figures."""


class WheelError(Exception):
    """pip could not download or install the wheels (exit status CHECK_FAILED_EXIT)."""


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------------------------------
# Wheels: download where the index is reachable, install on the bare machine
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Environment and the stages
# ---------------------------------------------------------------------------------------------------


@dataclass
class Context:
    device: "torch.device"
    quick: bool
    work: Path  # scratch space of this stage: <--work>/<stage>, or a temporary folder removed afterwards
    scale_rows: Optional[int] = None


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

    from rag_train.bench.machine import cpu_name

    env = {"device": device.type, "cpu": cpu_name(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "sentence_transformers": sentence_transformers.__version__, "accelerate": accelerate.__version__,
           "load_average": round(os.getloadavg()[0], 2)}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, driver=driver_version())
    return env


def gemm_peak(device) -> tuple[float, str]:
    """The same-run yardstick every fraction of a stage is of: FLOP/s of a large square matmul in the dtype the
    models run in (rag_train/bench/embed.py's)."""
    from rag_train.bench.embed import gemm_peak as measure

    return measure(device), ("bf16 8192^3 torch.mm" if device.type == "cuda" else "fp32 1024^3 torch.mm")


def fraction_goal(text: str, value: Optional[float], threshold: float, device) -> dict:
    met = None if value is None or device.type != "cuda" else bool(value >= threshold)
    return {"goal": text, "value": value, "met": met}


# --- embed ---------------------------------------------------------------------------------------------------


# sizes that ran in 142 s on an H100 (2026-11-25); 4x these outran a 300 s budget (ST.encode of 262,144 tiny rows
# alone takes a minute: its tokenisation runs in one process)
EMBED_GPU = {"shapes": ("tiny", "small", "base"), "lengths": (64, 128, 256), "at_128": {"tiny": 32768,
             "small": 4096, "base": 2048}, "batch_size": 1024, "workers": 8, "repeats": 2}
EMBED_QUICK = {"shapes": ("tiny",), "lengths": (64, 128, 256), "at_128": {"tiny": 16}, "batch_size": 8,
               "workers": 0, "repeats": 1}
TOY_PASSAGES = {False: 2000, True: 300}  # the toy world whose passages are glued into long ones (by --quick)


def profile_embed(model, corpus, rows, batch_size: int, device) -> dict:
    """One extra `embed_rows` pass with every host step in this process (0 workers) and the device synchronised
    around the forward: seconds in reads, tokenisation, collation, forward, and the rest (host <-> device copies,
    landing the vectors, the loop). Also counts the rows and real tokens the forward saw."""
    import rag_train.buffer.embed as embed_module
    from rag_train.bench.machine import synchronize
    from rag_train.buffer.embed import PassageTokenizer, embed_rows

    seconds = {"reads": 0.0, "tokenisation": 0.0, "collation": 0.0, "forward": 0.0}
    seen = {"rows": 0, "tokens": 0}

    def timed(part, fn, sync=False):
        def wrapped(*args, **kwargs):
            if sync:
                synchronize(device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                synchronize(device)
            seconds[part] += time.perf_counter() - start
            return out
        return wrapped

    forward = model.encode_passage_features

    def counted(features):
        seen["rows"] += int(features["attention_mask"].shape[0])
        seen["tokens"] += int(features["attention_mask"].sum())
        return forward(features)

    saved = [(PassageTokenizer, "encode", PassageTokenizer.encode), (PassageTokenizer, "features",
             PassageTokenizer.features), (embed_module, "plan_batches", embed_module.plan_batches)]
    PassageTokenizer.encode = timed("tokenisation", PassageTokenizer.encode)
    PassageTokenizer.features = timed("collation", PassageTokenizer.features)
    embed_module.plan_batches = timed("collation", embed_module.plan_batches)
    corpus.passages = timed("reads", corpus.passages)
    model.encode_passage_features = timed("forward", counted, sync=True)
    try:
        synchronize(device)
        start = time.perf_counter()
        embed_rows(model, corpus, rows, batch_size, device, num_workers=0)
        synchronize(device)
        total = time.perf_counter() - start
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        del corpus.passages, model.encode_passage_features
    seconds["copies and the rest"] = max(0.0, total - sum(seconds.values()))
    return {"seconds": total, "share": {k: v / total for k, v in seconds.items()}, **seen}


def stage_embed(ctx: Context) -> dict:
    import numpy as np
    import torch

    from rag_train.bench.embed import SHAPES, encoder_flops, long_passages, time_both
    from rag_train.config import RetrieverConfig
    from rag_train.data.toy_files import generate_toy_world
    from rag_train.models.retriever import DualEncoder

    cfg = EMBED_QUICK if ctx.quick else EMBED_GPU
    device = ctx.device
    peak, peak_how = gemm_peak(device)
    toy = ctx.work / "toy"
    generate_toy_world(toy, TOY_PASSAGES[ctx.quick], seed=0, progress=False)
    results = []
    for length in cfg["lengths"]:
        counts = {shape: max(8, cfg["at_128"][shape] * 128 // length) for shape in cfg["shapes"]}
        # each passage: enough toy passages (~35 tokens each) glued together to outrun `length` tokens
        corpus = long_passages(toy / "passages.jsonl", ctx.work / f"long-{length}.jsonl", max(counts.values()),
                               join=math.ceil(length / 20) + 1)
        for shape in cfg["shapes"]:
            model_cfg = RetrieverConfig(model="tiny", tiny=SHAPES[shape], shared_towers=True,
                                        max_passage_length=length)
            model = DualEncoder.from_config(model_cfg, tokenizer=str(toy / "tokenizer")).to(device).eval()
            rows = np.arange(counts[shape])
            ours, st, diff = time_both(model, corpus, cfg["batch_size"], cfg["workers"], device, cfg["repeats"], rows)
            profile = profile_embed(model, corpus, rows, cfg["batch_size"], device)
            if profile["rows"] != len(rows) or profile["tokens"] != len(rows) * length:
                raise StageCheckError(f"embed {shape} at {length} tokens: the forward saw {profile['rows']} rows and "
                                      f"{profile['tokens']} tokens, not {len(rows)} rows of exactly {length} tokens")
            flops = encoder_flops(model, length) * len(rows)
            results.append({"shape": shape, "length": length, "passages": len(rows), "ours_seconds": ours,
                            "st_seconds": st, "ours_passages_per_s": len(rows) / ours,
                            "st_passages_per_s": len(rows) / st, "ours_fraction_of_peak": flops / ours / peak,
                            "st_fraction_of_peak": flops / st / peak, "flops_per_passage": flops / len(rows),
                            "max_abs_diff": diff, "profile": profile})
            print(f"embed {shape:>5} {length:>3} tok {len(rows):>7} psg: embed_rows {len(rows) / ours:10.0f} psg/s "
                  f"({flops / ours / peak:.3f} of peak), ST {len(rows) / st:10.0f} psg/s, max|diff| {diff:.1e}",
                  flush=True)
            del model
    pick = {(r["shape"], r["length"]): r for r in results}
    base = pick.get(("base", 256))
    tiny = [r["ours_passages_per_s"] for r in results if r["shape"] == "tiny"]
    goals = [fraction_goal("base-shaped tower at 256 tokens: embed_rows >= 0.5 of the bf16 GEMM peak",
                           base and base["ours_fraction_of_peak"], 0.5, device),
             fraction_goal("tiny tower: embed_rows >= 100,000 passages/s (slowest of its lengths)",
                           min(tiny) if tiny else None, 100_000, device)]
    settings = {k: v for k, v in cfg.items() if k != "at_128"}
    return {"gemm_peak_flops": peak, "gemm_peak_how": peak_how, "settings": settings, "results": results,
            "goals": goals}


def render_embed(record: dict) -> list[str]:
    s = record["settings"]
    lines = [f"Towers are random-weight T5 encoders (rag_train/bench/embed.py: tiny = the toy retriever, small = "
             f"T5-v1.1-small, base = T5-v1.1-base, GTR-base's FLOPs); every passage is truncated to exactly the "
             f"length. Batch {s['batch_size']} rows, `embed_rows` with {s['workers']} DataLoader workers, best of "
             f"{s['repeats']}, both paths under the same autocast; fractions are encoder matmul FLOP/s over the "
             "same-run GEMM peak.", "",
             "| tower | tokens | passages | `embed_rows` psg/s | of peak | `SentenceTransformer.encode` psg/s "
             "| of peak | ratio | max abs diff |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["results"]:
        lines.append(f"| {r['shape']} | {r['length']} | {r['passages']:,} | {r['ours_passages_per_s']:,.0f} | "
                     f"{r['ours_fraction_of_peak']:.3f} | {r['st_passages_per_s']:,.0f} | "
                     f"{r['st_fraction_of_peak']:.3f} | {r['st_seconds'] / r['ours_seconds']:.2f}x | "
                     f"{r['max_abs_diff']:.1e} |")
    missing = [x for x in ("tiny", "small", "base") if x not in s["shapes"]]
    if missing:
        lines.append(f"\n(Not run at this size: {', '.join(missing)}.)")
    lines += ["", "Host-side profile of `embed_rows` (one more pass, every host step in the main process, device "
              "synchronised around the forward; shares of that pass's wall time):", "",
              "| tower | tokens | reads | tokenisation | collation | forward | copies and the rest |",
              "|---|---|---|---|---|---|---|"]
    for r in record["results"]:
        share = r["profile"]["share"]
        lines.append(f"| {r['shape']} | {r['length']} | " + " | ".join(
            f"{100 * share[k]:.1f}%" for k in ("reads", "tokenisation", "collation", "forward", "copies and the rest"))
            + " |")
    return lines


# --- forward -------------------------------------------------------------------------------------------------


FORWARD_GPU = {"shapes": ("tiny", "small", "base"), "lengths": (64, 256), "batch": 1024, "repeats": 10,
               "tokenise_rows": 32768}
FORWARD_QUICK = {"shapes": ("tiny",), "lengths": (16, 32), "batch": 8, "repeats": 2, "tokenise_rows": 64}
KERNEL_CLASSES = ("GEMM, 16-bit", "GEMM, fp32", "fused attention", "softmax", "the rest (elementwise, norms, copies)")


def kernel_class(name: str) -> str:
    """The class of one CUDA kernel, or of one aten op on CPU (where every GEMM is fp32), in a forward's profile."""
    low = name.lower()
    if any(k in low for k in ("fmha", "flash", "efficient_attention")):
        return "fused attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")):
        return "GEMM, fp32" if low.startswith("aten::") or "f32f32" in low or "sgemm" in low else "GEMM, 16-bit"
    return "softmax" if "softmax" in low else KERNEL_CLASSES[-1]


def forward_profile(fn, device) -> dict:
    """Shares of one call's device time (CUDA kernels; on CPU the leaf ops' own time) per KERNEL_CLASSES."""
    from torch.profiler import ProfilerActivity, profile

    from rag_train.bench.machine import synchronize

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU], acc_events=True) as prof:
        fn()
        synchronize(device)
    totals = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for event in prof.key_averages():
        own = event.self_device_time_total if cuda else event.self_cpu_time_total
        if own > 0 and (cuda or event.key.startswith("aten::")):
            totals[kernel_class(event.key)] += own
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in totals.items()}


def stage_forward(ctx: Context) -> dict:
    """The passage tower's forward alone (what `embed_rows` runs per batch: `encode_passage_features` under
    `autocast_for`), on device-resident token ids of exactly each length: how near it comes to the GEMM peak, the
    same with bf16 weights and no autocast, where its device time goes; and how fast the host tokenises."""
    import numpy as np
    import torch

    from rag_train.bench.embed import SHAPES, encoder_flops, long_passages
    from rag_train.bench.search import best_time
    from rag_train.buffer.embed import PassageTokenizer, autocast_for
    from rag_train.config import RetrieverConfig
    from rag_train.data.toy_files import generate_toy_world
    from rag_train.models.retriever import DualEncoder, format_passage

    cfg = FORWARD_QUICK if ctx.quick else FORWARD_GPU
    device = ctx.device
    peak, peak_how = gemm_peak(device)
    toy = ctx.work / "toy"
    generate_toy_world(toy, TOY_PASSAGES[ctx.quick], seed=0, progress=False)

    results, tokenise = [], []
    for length in cfg["lengths"]:
        for shape in cfg["shapes"]:
            model = DualEncoder.from_config(RetrieverConfig(model="tiny", tiny=SHAPES[shape], shared_towers=True,
                                                            max_passage_length=length),
                                            tokenizer=str(toy / "tokenizer")).to(device).eval()
            generator = torch.Generator().manual_seed(0)
            ids = torch.randint(5, 500, (cfg["batch"], length), generator=generator).to(device)
            features = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            flops = encoder_flops(model, length) * cfg["batch"]
            attention = model.passage_encoder[0].auto_model.config._attn_implementation
            tokenizer = PassageTokenizer.for_passages(model)  # the towers of one length share the toy tokenizer
            with torch.inference_mode():
                def autocast_forward():
                    with autocast_for(device):
                        return model.encode_passage_features(features)

                reference = autocast_forward().float()
                seconds = best_time(autocast_forward, cfg["repeats"], device=device)
                shares = forward_profile(autocast_forward, device)
                model.to(torch.bfloat16)
                low = model.encode_passage_features(features).float()
                low_seconds = best_time(lambda: model.encode_passage_features(features), cfg["repeats"],
                                        device=device)
            agreement = torch.nn.functional.cosine_similarity(low, reference, dim=1).min().item()
            if not agreement > 0.99:
                raise StageCheckError(f"forward {shape} at {length} tokens: bf16 weights give vectors at cosine "
                                      f"{agreement:.4f} of the autocast ones")
            results.append({"shape": shape, "length": length, "rows": cfg["batch"], "attention": attention,
                            "autocast_seconds": seconds, "autocast_fraction_of_peak": flops / seconds / peak,
                            "bf16_seconds": low_seconds, "bf16_fraction_of_peak": flops / low_seconds / peak,
                            "min_cosine_bf16_vs_autocast": agreement, "device_time_shares": shares})
            print(f"forward {shape:>5} {length:>3} tok x {cfg['batch']}: autocast {seconds * 1e3:8.1f} ms "
                  f"({flops / seconds / peak:.3f} of peak), bf16 weights {low_seconds * 1e3:8.1f} ms "
                  f"({flops / low_seconds / peak:.3f}); " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()),
                  flush=True)
            del model
        corpus = long_passages(toy / "passages.jsonl", ctx.work / f"long-{length}.jsonl", cfg["tokenise_rows"],
                               join=math.ceil(length / 20) + 1)
        texts = [format_passage(p) for p in corpus.passages(np.arange(len(corpus)))]
        rates, previous = {}, os.environ.get("TOKENIZERS_PARALLELISM")
        for mode, parallel in (("Rust threads", "true"), ("one thread", "false")):
            os.environ["TOKENIZERS_PARALLELISM"] = parallel  # read by each call into the Rust library
            start = time.perf_counter()
            _, lengths = tokenizer.encode(texts)
            rates[mode] = len(texts) / (time.perf_counter() - start)
            if int(lengths.min()) != length:
                raise StageCheckError(f"tokenise at {length}: a passage came out {int(lengths.min())} tokens long")
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
        tokenise.append({"length": length, "rows": len(texts), "rows_per_s": rates, "cpus": os.cpu_count()})
        print(f"tokenise {length:>3} tok {len(texts)} rows: " + ", ".join(f"{k} {v:,.0f} rows/s"
                                                                         for k, v in rates.items()), flush=True)
    return {"gemm_peak_flops": peak, "gemm_peak_how": peak_how, "settings": dict(cfg), "results": results,
            "tokenise": tokenise, "goals": []}


def render_forward(record: dict) -> list[str]:
    s = record["settings"]
    lines = [f"The passage tower's forward alone, as `embed_rows` runs it per batch (`encode_passage_features` under "
             f"`autocast_for`), on {s['batch']} rows of token ids already on the device, exactly the length wide; "
             f"best of {s['repeats']} after one warm-up; then the same with the weights cast to bf16 and no "
             "autocast. Fractions are encoder matmul FLOP/s over the same-run GEMM peak; the shares split one "
             "autocast forward's device time (CPU: the aten ops' own time) by kernel.", "",
             "| tower | tokens | attention | autocast ms | of peak | bf16 weights ms | of peak | "
             + " | ".join(KERNEL_CLASSES) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(KERNEL_CLASSES)]
    for r in record["results"]:
        shares = " | ".join(f"{100 * r['device_time_shares'][k]:.0f}%" for k in KERNEL_CLASSES)
        lines.append(f"| {r['shape']} | {r['length']} | {r['attention']} | {r['autocast_seconds'] * 1e3:.1f} | "
                     f"{r['autocast_fraction_of_peak']:.3f} | {r['bf16_seconds'] * 1e3:.1f} | "
                     f"{r['bf16_fraction_of_peak']:.3f} | {shares} |")
    lines += ["", "Host tokenisation (`PassageTokenizer.encode`, the Rust batch call `embed_rows` makes; passages longer "
              "than the length, truncated to it) in one process, with the Rust library's threads and with one thread "
              "(as in each `embed_rows` DataLoader worker):", "",
              "| tokens | passages | CPUs | Rust threads rows/s | one thread rows/s |", "|---|---|---|---|---|"]
    for t in record["tokenise"]:
        lines.append(f"| {t['length']} | {t['rows']:,} | {t['cpus']} | {t['rows_per_s']['Rust threads']:,.0f} | "
                     f"{t['rows_per_s']['one thread']:,.0f} |")
    return lines


# --- search --------------------------------------------------------------------------------------------------


SEARCH_GPU = ["--rows", "28000000", "--dim", "768", "--hidden", "8192", "--batch", "64", "--k", "32", "--chunk",
              "262144", "--dtype", "bf16", "--repeats", "3", "--seed", "0"]
SEARCH_QUICK = ["--rows", "4096", "--dim", "16", "--hidden", "32", "--batch", "4", "--k", "5", "--chunk", "1000",
                "--dtype", "fp32", "--repeats", "1", "--seed", "0"]


def stage_search(ctx: Context) -> dict:
    from rag_train.bench import search as bench_search

    argv = (SEARCH_QUICK if ctx.quick else SEARCH_GPU) + ["--device", ctx.device.type]
    args = bench_search.parse_args(argv)
    figures = bench_search.device_part(args)
    for mode in ("exact", "corrector_full"):
        if figures[mode]["same_ids_as_plain"] < (0.999 if args.dtype == "fp32" else 0.95):
            raise StageCheckError(f"search {mode}: top-{args.k} shares only {figures[mode]['same_ids_as_plain']:.4f} "
                                  "of its ids with the plain torch reference")
    settings = {k: getattr(args, k) for k in ("rows", "dim", "hidden", "batch", "k", "chunk", "dtype", "repeats",
                                              "seed")}
    goals = [fraction_goal("corrector-full search >= 0.8 of the bf16 GEMM peak",
                           figures["corrector_full"]["fraction_of_peak"], 0.8, ctx.device)]
    return {"gemm_peak_flops": figures["gemm_tflops"] * 1e12,
            "gemm_peak_how": f"{args.dtype} {8192 if ctx.device.type == 'cuda' else 2048}^3 torch.mm",
            "settings": settings, "results": figures, "goals": goals}


def render_search(record: dict) -> list[str]:
    s, f = record["settings"], record["results"]
    e, c = f["exact"], f["corrector_full"]
    lines = [f"Buffer {s['rows']:,} x {s['dim']} {s['dtype']} on the device ({f['buffer_gib']:.2f} GiB, L2-normalised "
             f"random rows), {s['batch']} queries, k = {s['k']}, corrector hidden {s['hidden']}, chunk {s['chunk']:,} "
             f"rows; best of {s['repeats']} (rag_train/bench/search.py `device_part`). Copy bandwidth (read + "
             f"written) {f['copy_gbs']:.0f} GB/s.", "",
             "| search | ours | plain torch | ratio | same ids as plain | rate | extra memory ours / plain |",
             "|---|---|---|---|---|---|---|",
             f"| exact `<q, B>` | {1e3 * e['seconds']:.1f} ms | {1e3 * e['plain_seconds']:.1f} ms (`topk(q @ B^T)`) | "
             f"{e['seconds'] / e['plain_seconds']:.2f} | {e['same_ids_as_plain']:.4f} | reads {e['read_gbs']:.0f} GB/s "
             f"= {e['fraction_of_copy_bandwidth']:.2f} of copy bandwidth | {e['extra_gib']:.2f} / "
             f"{e['plain_extra_gib']:.2f} GiB |",
             f"| corrector-full `<q, h(B)>` | {1e3 * c['seconds']:.1f} ms | {1e3 * c['plain_seconds']:.1f} ms (h(B) "
             f"chunks) | {c['seconds'] / c['plain_seconds']:.2f} | {c['same_ids_as_plain']:.4f} | {c['tflops']:.3f} "
             f"TFLOP/s = **{c['fraction_of_peak']:.2f} of peak** | {c['extra_gib']:.2f} / {c['plain_extra_gib']:.2f} "
             "GiB |", "", "Corrector-full, per kernel (one chunk timed alone x chunks; share of the search):", "",
             "| kernel | ms | share |", "|---|---|---|"]
    for name, seconds in f["corrector_breakdown_seconds"].items():
        lines.append(f"| {name} | {1e3 * seconds:.1f} | {100 * seconds / c['seconds']:.0f}% |")
    return lines


# --- step ----------------------------------------------------------------------------------------------------


STEP_GPU = ["--size", "base", "--passages", "32", "--passage-length", "256", "--dtype", "bf16", "--checkpointing",
            "--steps", "5", "--warmup", "2", "--corpus-rows", "4096", "--corrector-hidden", "8192"]
STEP_QUICK = ["--size", "tiny", "--passages", "3", "--passage-length", "12", "--question-length", "5",
              "--answer-length", "4", "--dtype", "fp32", "--checkpointing", "--steps", "1", "--warmup", "1",
              "--corpus-rows", "64", "--corrector-hidden", "32", "--candidates", "5"]
STEP_BATCHES = (1, 4)
STEP_SHAPES = {"tiny": ("the toy's tiny T5", "the toy's tiny encoder"),
               "small": ("t5-small-lm-adapt", "t5-small (GTR-style)"),
               "base": ("t5-base-lm-adapt", "gtr-t5-base")}
MEMORY_KINDS = {"torch.cuda.max_memory_allocated": "max allocated"}


def stage_step(ctx: Context) -> dict:
    import torch
    from accelerate.state import AcceleratorState

    from rag_train.bench import rlm_step

    peak, peak_how = gemm_peak(ctx.device)
    runs = []
    for batch in STEP_BATCHES:
        # one accelerate state per process: each run (like a user's) sets its own mixed precision; and the last
        # run's models, optimizer and buffer gone from the device, so this run's memory is its own
        AcceleratorState._reset_state()
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        argv = (STEP_QUICK if ctx.quick else STEP_GPU) + ["--batch", str(batch), "--device", ctx.device.type]
        try:
            result = rlm_step.main(argv + ["--json", str(ctx.work / f"step-{batch}.json")])
        except rlm_step.BenchmarkCheckError as exc:
            raise StageCheckError(f"step, {batch} question(s): {exc}") from exc
        runs.append(result)
    AcceleratorState._reset_state()
    return {"gemm_peak_flops": peak, "gemm_peak_how": peak_how, "settings": {"argv": STEP_QUICK if ctx.quick
            else STEP_GPU, "batches": list(STEP_BATCHES)}, "results": runs, "goals": []}


def render_step(record: dict) -> list[str]:
    first = record["results"][0]
    shape, params = first["shape"], first["parameters"]
    reader, retriever = STEP_SHAPES[shape["size"]]
    lines = [f"`RLMRecipe.train_step` itself (rag_train/bench/rlm_step.py), random weights: reader shaped like "
             f"{reader} ({params['reader']:,} parameters), retriever two towers shaped like {retriever} "
             f"({params['retriever']:,}), corrector hidden {shape['corrector_hidden']} ({params['corrector']:,}); "
             f"{shape['passages']} passages x "
             f"{shape['passage_length']} tokens per question, {shape['dtype']}, checkpointing "
             f"{'on' if shape['checkpointing'] else 'off'}, median of {shape['steps']} steps after {shape['warmup']} "
             "warm-up. \"Without reuse\" adds to the step what re-encoding the passages for the per-passage answer "
             "likelihoods costs over reusing the FiD encoder states (both timed side by side on the step's inputs).",
             "", "| questions | step (encoder reuse) | step without reuse (est.) | reuse saves | P(a\\|y,x) reuse / "
             "re-encode | peak memory | reuse == re-encode (fp32) |", "|---|---|---|---|---|---|---|"]
    for r in record["results"]:
        t, lk, chk = r["step"], r["likelihoods"], r["check"]
        lines.append(f"| {r['shape']['batch']} | {t['median_s']:.3f} s | {t['median_s'] + lk['saving_s']:.3f} s | "
                     f"{100 * lk['saving_fraction_of_step']:.1f}% | {lk['reuse_median_s']:.4f} / "
                     f"{lk['reencode_median_s']:.4f} s | {r['memory']['peak_bytes'] / 2**30:.2f} GiB "
                     f"({MEMORY_KINDS.get(r['memory']['kind'], 'peak process RSS')}) | "
                     f"{chk['max_abs_diff_reuse_vs_reencode']:.1e} |")
    return lines


# --- scale ---------------------------------------------------------------------------------------------------


SCALE_GPU_ROWS, SCALE_QUICK_ROWS = 5_000_000, 600
SCALE_GPU = {"steps": 50, "threads": 0, "overrides": [
    "buffer.embed_workers=8", "buffer.embed_batch_size=1024", "buffer.chunk_rows=1048576",
    "warm_start.reader_steps=200", "warm_start.reader_copy_steps=100", "pdist_gate=0", "train.log_every=10"]}
SCALE_QUICK = {"steps": 3, "threads": 1, "overrides": [
    "retriever.tiny.d_model=16", "retriever.tiny.d_ff=32", "retriever.tiny.d_kv=8", "retriever.tiny.num_heads=2",
    "retriever.tiny.num_layers=1", "retriever.max_passage_length=32", "retriever.max_query_length=16",
    "reader.tiny.d_model=32", "reader.tiny.d_ff=64", "reader.tiny.d_kv=8", "reader.tiny.num_heads=4",
    "reader.tiny.num_layers=1", "reader.tiny.num_decoder_layers=1", "reader.max_input_length=48",
    "warm_start.reader_steps=2", "warm_start.reader_copy_steps=1", "warm_start.retriever_steps=2", "strategy.top_k=4",
    "strategy.corrector.candidates=8", "strategy.corrector.hidden=32", "train.batch_size=4", "train.log_every=1",
    "buffer.embed_batch_size=256", "buffer.embed_workers=0", "data.max_train_examples=50",
    "data.max_eval_examples=8", "eval.batch_size=16", "pdist_gate=0"]}
TARGET_ROWS = 28_000_000


def stage_scale(ctx: Context) -> dict:
    import torch

    from rag_train.bench import scale
    from rag_train.bench.rlm_step import accelerate_device
    from rag_train.config import DataConfig, load_config
    from rag_train.data.corpus import Corpus
    from rag_train.data.toy_files import ensure_toy_world
    from rag_train.train.schema import RLMConfig

    cfg = SCALE_QUICK if ctx.quick else SCALE_GPU
    rows = ctx.scale_rows or (SCALE_QUICK_ROWS if ctx.quick else SCALE_GPU_ROWS)
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    peak, peak_how = gemm_peak(ctx.device)
    toy, run_dir = ctx.work / f"toy-{rows}", ctx.work / f"run-{rows}"
    if run_dir.exists() and not (run_dir / "scale-stage.json").is_file():
        shutil.rmtree(run_dir)  # an earlier call's run cut off by its time limit: start the run over
    reused = (toy / "manifest.json").is_file()  # an earlier call's world (--work on a still-warm machine)
    started = time.perf_counter()
    workers = 1 if ctx.quick else os.cpu_count() or 1  # passages rendered in this many processes
    files = ensure_toy_world(DataConfig(toy_dir=str(toy), toy_passages=rows), workers=workers)
    generate_s = None if reused else time.perf_counter() - started
    started = time.perf_counter()
    corpus_rows = len(Corpus.open(files["passages"]))
    index_s = None if reused else time.perf_counter() - started  # the index is kept beside a reused world
    overrides = [f"data.toy_dir={toy}", f"data.toy_passages={rows}", "train.tracker=null", "train.eval_every=0",
                 "train.save_every=0", f"train.output_dir={run_dir}", f"train.steps={cfg['steps']}",
                 "strategy.name=corrector", *cfg["overrides"]]
    config = load_config(RLMConfig, ROOT / "configs" / "toy" / "rlm.yaml", overrides)
    probe = scale.Probe()
    with scale.instrumented(probe), accelerate_device(ctx.device.type):
        run = scale.run_stage("corrector", config, probe)
    return {"gemm_peak_flops": peak, "gemm_peak_how": peak_how,
            "settings": {"rows": rows, "steps": cfg["steps"], "overrides": cfg["overrides"], "work": str(ctx.work),
                         "world_workers": workers},
            "results": {"rows": corpus_rows, "generate_seconds": generate_s, "index_seconds": index_s, "run": run,
                        "projection": project_scale(rows, generate_s, index_s, run)}, "goals": []}


def project_scale(rows: int, generate_s: Optional[float], index_s: Optional[float], run: dict) -> dict:
    """Seconds each stage would take at TARGET_ROWS from this run's measured rates: generation, indexing, corpus
    passes and the buffer search scale with the rows; the rest of a step and the warm starts do not."""
    factor = TARGET_ROWS / rows
    passes = {p["reason"]: p["seconds"] for p in run["corpus_passes"]}
    phases, loop = run["phase_seconds"], run["loop_seconds"] or 0.0
    search = run["loop_host_seconds"].get("buffer search", 0.0)
    build = passes.get("stale buffer build", 0.0)
    final_pass = passes.get("final evaluation", 0.0)
    final = phases.get("final evaluation", 0.0)
    return {
        "generate": None if generate_s is None else generate_s * factor,
        "index": None if index_s is None else index_s * factor,
        "warm starts and setup": max(0.0, run["wall_seconds"] - build - loop - final),
        "buffer build": build * factor,
        "steps": loop + search * (factor - 1),
        "final evaluation": final + final_pass * (factor - 1),
    }


def render_scale(record: dict) -> list[str]:
    s, r = record["settings"], record["results"]
    run, proj = r["run"], r["projection"]
    passes = {p["reason"]: p for p in run["corpus_passes"]}
    phases = run["phase_seconds"]
    loop = run["loop_seconds"] or float("nan")

    def rate(rows, seconds):
        return f"{rows / seconds:,.0f} passages/s" if seconds else "-"

    device_peak = run.get("peak_device_gib") or {}
    rss = run["peak_rss_gib"]

    def mem(phase):
        return f"{rss.get(phase, 0):.2f} GiB" + (f" / {device_peak.get(phase, 0):.2f} GiB" if device_peak else "")

    build, final = passes.get("stale buffer build", {}), passes.get("final evaluation", {})
    lines = [f"`train_rlm` (the main job, configs/toy/rlm.yaml with the overrides below) on a {r['rows']:,}-passage "
             f"toy world built from scratch (passages rendered in {s['world_workers']} process(es)), {s['steps']} "
             "Algorithm-2 steps through the corrector (retriever gate "
             f"open from step 0), then the final evaluation (rag_train/bench/scale.py). Overrides: "
             f"`{' '.join(s['overrides'])}`.", "",
             f"| stage | wall | rate | peak host RSS{' / device' if device_peak else ''} | at {TARGET_ROWS:,} "
             "rows (projected) |", "|---|---|---|---|---|",
             (f"| generate the toy world | {r['generate_seconds']:.1f} s | {rate(r['rows'], r['generate_seconds'])} | "
              f"| {proj['generate'] / 60:.1f} min |" if r["generate_seconds"] is not None else
              "| generate the toy world | reused from an earlier call: not measured | | | |"),
             (f"| index the corpus | {r['index_seconds']:.2f} s | {rate(r['rows'], r['index_seconds'])} | | "
              f"{proj['index'] / 60:.1f} min |" if r["index_seconds"] is not None else
              "| index the corpus | reused from an earlier call: not measured | | | |"),
             f"| warm starts, setup (the rest of the run) | {proj['warm starts and setup']:.1f} s | | "
             f"{mem('warm start')} | {proj['warm starts and setup'] / 60:.1f} min |",
             f"| stale buffer build (corpus pass) | {build.get('seconds', 0):.1f} s | "
             f"{rate(build.get('rows', 0), build.get('seconds', 0))} | {mem('buffer build')} | "
             f"{proj['buffer build'] / 60:.1f} min |",
             f"| {run['steps']} corrector steps | {loop:.1f} s | {run['steps'] / loop:.2f} steps/s | "
             f"{mem('algorithm-2 steps')} | {proj['steps'] / 60:.1f} min |",
             f"| final evaluation (corpus pass + FiD generation) | {phases.get('final evaluation', 0):.1f} s | "
             f"pass {rate(final.get('rows', 0), final.get('seconds', 0))} | {mem('final evaluation')} | "
             f"{proj['final evaluation'] / 60:.1f} min |",
             f"| whole run (train_rlm) | {run['wall_seconds']:.1f} s | | | |", "",
             "Host-side share of a step (functions the recipe calls, timed inside its training loop): " + ", ".join(
                 f"{name} {100 * share:.1f}%" for name, share in sorted(run.get("loop_share", {}).items())) + ".",
             "", f"Projection to {TARGET_ROWS:,} rows: generation, indexing, the corpus passes and the buffer search "
             "at this run's rates times the rows (fixed costs included, so a small world overstates them); warm "
             "starts and the rest of a step as measured."]
    return lines


@dataclass(frozen=True)
class Stage:
    name: str
    minutes: float  # expected on one H100, all included
    what: str
    run: Callable[[Context], dict]
    render: Callable[[dict], list]
    scales: str


STAGES = {s.name: s for s in [
    Stage("embed", 3, "embed_rows vs SentenceTransformer.encode (GPU: tiny / small / base towers at 64 / 128 / 256 "
          "tokens), host-side profile", stage_embed, render_embed,
          "time linear in the passages per row (32k / 4k / 2k at 128 tokens for tiny / small / base)"),
    Stage("forward", 1.5, "the passage tower's forward alone (GPU: tiny / small / base at 64 / 256 tokens, 1024 rows): "
          "fraction of peak, with bf16 weights, device time by kernel class; host tokenisation rate",
          stage_forward, render_forward, "time linear in the repeats and the rows per forward"),
    Stage("search", 1, "exact and corrector-full search of a buffer held on the device (GPU: 28M x 768 bf16)",
          stage_search, render_search, "time linear in the buffer rows; the buffer takes rows x 768 x 2 bytes"),
    Stage("step", 2, "RLMRecipe.train_step (GPU: base size, FiD 32 x 256 + GTR-base), 1 and 4 questions",
          stage_step, render_step, "time linear in the steps timed; memory in questions x passages x tokens"),
    Stage("scale", 8, "train_rlm end to end on a toy world built from scratch (GPU: 5M passages), 28M projected",
          stage_scale, render_scale, "generation, indexing and the corpus passes linear in --scale-rows"),
]}


# ---------------------------------------------------------------------------------------------------
# Fragments and the assembled document
# ---------------------------------------------------------------------------------------------------


def device_label(record: dict) -> str:
    env = record["environment"]
    where = env.get("gpu", env["cpu"]) if env["device"] == "cuda" else "cpu"
    return f"{where}{' (quick)' if record['quick'] else ''}"


def fragment_markdown(record: dict) -> str:
    stage, env = STAGES[record["stage"]], record["environment"]
    versions = f"torch {env['torch']}" + (f", CUDA {env['cuda']}, driver {env['driver']}" if env["device"] == "cuda"
                                          else f", {env['cpu']}, torch threads {env['torch_threads']}, load average "
                                          f"{env['load_average']}")
    lines = [f"## {stage.name}: {stage.what}", "",
             f"device: {device_label(record)} · {versions} · same-run GEMM peak "
             f"{record['gemm_peak_flops'] / 1e12:.3f} TFLOP/s ({record['gemm_peak_how']}) · stage wall "
             f"{record['seconds']:.0f} s", ""]
    lines += stage.render(record)
    if record["goals"]:
        lines += ["", "| goal | measured | met |", "|---|---|---|"]
        for goal in record["goals"]:
            value = "-" if goal["value"] is None else f"{goal['value']:,.3f}" if goal["value"] < 10 else \
                f"{goal['value']:,.0f}"
            met = {True: "yes", False: "**no**", None: "not judged (GPU goal; not a GPU run)" if record["environment"]
                   ["device"] != "cuda" else "not measured"}[goal["met"]]
            lines.append(f"| {goal['goal']} | {value} | {met} |")
    return "\n".join(lines) + "\n"


def run_stage(name: str, ctx: Context, out: Path) -> dict:
    """Run one stage and write `<name>.json` and `<name>.md` under `out`."""
    from rag_train.bench.machine import synchronize

    started = time.perf_counter()
    record = {"stage": name, "quick": ctx.quick, "environment": environment(ctx.device)}
    record.update(STAGES[name].run(ctx))
    synchronize(ctx.device)
    record["seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(fragment_markdown(record))
    print(f"stage {name}: {record['seconds']:.0f} s -> {out / (name + '.json')}, {out / (name + '.md')}", flush=True)
    return record


def commands_markdown() -> list[str]:
    stages = ", ".join(f"`{s.name}` ~{s.minutes:g} min" for s in STAGES.values())
    return [
        "## Commands", "",
        "On a machine that reaches the package index, once (the wheels a bare GPU image lacks: "
        f"{', '.join(STAGE_WHEELS)} and what they need beyond the image, at the versions installed there, for "
        f"CPython {GPU_PYTHON} on x86-64 Linux; when this page was assembled: {', '.join(wheel_requirements())}; "
        "about 20 MiB; `.whl/` is git-ignored):", "",
        "```bash", "python scripts/gpu_report.py --wheels .whl", "```", "",
        f"On the GPU machine, one stage per command, each under a 10-minute limit ({stages} on one H100). With the "
        "device tool: `run` with `carry: [\".whl\"]`, `timeout_s: 600` and the command below; each stage installs "
        "the wheels from `.whl/` (into /tmp/rag-train-site) before it imports anything that needs them, builds "
        "what it needs from scratch and writes `<stage>.json` + `<stage>.md` into `$OUT`, which come back:", "",
        "```bash",
        *[f"PYTHONUNBUFFERED=1 python3 scripts/gpu_report.py --stage {s} --device cuda --out $OUT "
          "--work runs/gpu_report" for s in STAGES],
        "```", "",
        "The reply's `files_at` folder holds the stage's two files: copy them into `docs/gpu_report/` (replacing "
        "that stage's CPU fragments) and assemble this page from whatever is there (a stage with no fragment is "
        "listed as missing):", "",
        "```bash", "python scripts/gpu_report.py --assemble --out docs/gpu_report", "```", "",
        "`--stage list` prints the stages with their expected minutes; `--stage all` runs them one after another "
        "(longer than one 10-minute command on a GPU); `--device cpu --quick --stage all` runs every stage at toy "
        "size with one torch thread (`tests/test_gpu_report.py`; the fragments under `docs/gpu_report/` came from "
        "`--device cpu --quick --stage all --out docs/gpu_report`). If `scale` outruns its limit, a second call on "
        "the still-warm machine with the same `--work` reuses the world the first one generated and indexed "
        "(those two rows then read 'not measured'), or `--scale-rows` makes the world smaller (generation, indexing and the "
        "corpus passes are linear in the rows). Exit status: 0 done, 1 a stage's own check "
        "failed (its results disagree with their reference; no fragment is written) or pip failed, 2 bad "
        "arguments (unknown stage, `--device cuda` without a GPU, `--device cpu` without `--quick`, nothing to "
        "assemble).",
    ]


NOTES = "findings.md"  # beside the fragments: the findings of the last GPU session, by hand, placed after the table


def assemble(fragments: Path, doc: Path) -> dict:
    """Write `doc` from the fragments in `fragments`, in stage order, with `fragments`/NOTES after the summary
    table if it exists; returns {stage: record or None}."""
    records = {}
    for name in STAGES:
        path = fragments / f"{name}.json"
        records[name] = json.loads(path.read_text()) if path.is_file() else None
    present = [r for r in records.values() if r]
    if not present:
        raise ReportError(f"{fragments}: no stage fragments (<stage>.json) to assemble")
    missing = [name for name, r in records.items() if r is None]
    on_gpu = [r["stage"] for r in present if r["environment"]["device"] == "cuda" and not r["quick"]]
    lines = ["# GPU report: every GPU figure from one command", "",
             "Written by `python scripts/gpu_report.py --assemble` from the fragments in "
             f"`{fragments.as_posix()}` (rag_train/bench/gpu_report.py); each stage times the code users run.", ""]
    if len(on_gpu) < len(STAGES):
        pending = [name for name in STAGES if name not in on_gpu]
        lines += [f"> **GPU figures pending a GPU session** for: {', '.join(pending)}. "
                  + ("The tables of those stages below come from `--device cpu --quick` (toy sizes, to show every "
                     "table is produced and its checks pass; their speeds say nothing about a GPU). "
                     if any(r["environment"]["device"] == "cpu" for r in present) else "")
                  + "The GPU path of a pending stage has not run yet: its sizes and expected minutes are estimates. "
                  "To produce the figures, run `python3 scripts/gpu_report.py --stage NAME --device cuda --out DIR` "
                  "for each on a GPU machine (exact commands under *Commands*), then `--assemble`.", ""]
    lines += ["| stage | device | driver | torch | CUDA | same-run GEMM peak | stage wall | expected on one H100 "
              "(estimate) |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in records.items():
        if r is None:
            lines.append(f"| {name} | **missing** | | | | | | ~{STAGES[name].minutes:g} min |")
            continue
        env = r["environment"]
        lines.append(f"| {name} | {device_label(r)} | {env.get('driver') or '-'} | {env['torch']} | "
                     f"{env.get('cuda') or '-'} | {r['gemm_peak_flops'] / 1e12:.3f} TFLOP/s ({r['gemm_peak_how']}) | "
                     f"{r['seconds']:.0f} s | ~{STAGES[name].minutes:g} min |")
    lines += ["", f"Missing stages: {', '.join(missing) if missing else 'none'}.", ""]
    notes = fragments / NOTES
    if notes.is_file():  # what the figures mean and why, written by whoever ran them (not generated)
        lines += [notes.read_text().rstrip(), ""]
    for r in present:
        lines.append(fragment_markdown(r))
    lines += commands_markdown()
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines) + "\n")
    print(f"wrote {doc}: {len(present)} stage(s), missing: {', '.join(missing) or 'none'}")
    return records


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--stage", choices=[*STAGES, "all", "list"], help="run one stage, all, or list them")
    action.add_argument("--assemble", action="store_true", help="write --doc from the fragments in --out")
    action.add_argument("--wheels", metavar="DIR", help="download the wheels a bare GPU machine lacks into DIR")
    parser.add_argument("--out", default=None, help="folder of the stage fragments (<stage>.json / .md)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--quick", action="store_true", help="toy sizes (CI; on CPU the only sensible choice)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "gpu_report.md"), help="--assemble writes this")
    parser.add_argument("--wheels-dir", default=str(ROOT / ".whl"), help="wheels a stage installs first, if there")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed after)")
    parser.add_argument("--scale-rows", type=int, default=None, help="toy passages of the scale stage")
    args = parser.parse_args(argv)
    if (args.stage not in (None, "list") or args.assemble) and not args.out:
        parser.error("--out DIR is required to run a stage or to assemble")
    if args.scale_rows is not None and args.scale_rows < 100:
        parser.error("--scale-rows must be at least 100")
    return args


def list_stages() -> None:
    for s in STAGES.values():
        print(f"{s.name:<7} ~{s.minutes:g} min on one H100 (estimated)  {s.what} (scales: {s.scales})")
    print(f"all     ~{sum(s.minutes for s in STAGES.values()):g} min (on a GPU: one stage per 10-minute command)")


def run_stages(args: argparse.Namespace) -> None:
    installed = install_wheels(Path(args.wheels_dir), Path(tempfile.gettempdir()) / "rag-train-site")
    if installed:
        print(f"installed from {args.wheels_dir}: {', '.join(installed)}", flush=True)
    import torch

    from rag_train.cli import exit_on_fault

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cuda", "cpu"):
        raise ReportError(f"--device {name}: expected cuda or cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ReportError("--device cuda, but torch sees no CUDA device (use --device cpu --quick)")
    if name == "cpu" and not args.quick:
        raise ReportError("--device cpu runs only with --quick: the full sizes are a GPU's (a 28M x 768 buffer, "
                          "base-size models); the benchmarks' own scripts take other CPU sizes")
    if args.quick:  # toy sizes: a second thread only spins against the other processes of a shared CI machine
        torch.set_num_threads(1)
    names = list(STAGES) if args.stage == "all" else [args.stage]
    with exit_on_fault(), tempfile.TemporaryDirectory(prefix="gpu-report-") as tmp:
        for stage in names:
            work = Path(args.work) / stage if args.work else Path(tmp) / stage
            work.mkdir(parents=True, exist_ok=True)
            run_stage(stage, Context(torch.device(name), args.quick, work, args.scale_rows), Path(args.out))


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        if args.stage == "list":
            list_stages()
        elif args.wheels:
            download_wheels(Path(args.wheels))
        elif args.assemble:
            assemble(Path(args.out), Path(args.doc))
        else:
            run_stages(args)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(INPUT_FAULT_EXIT) from exc
    except (StageCheckError, WheelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(CHECK_FAILED_EXIT) from exc

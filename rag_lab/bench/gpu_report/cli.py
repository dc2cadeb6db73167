"""`scripts/gpu_report.py`: run a stage, list them, download the wheels or assemble the document."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import rag_lab.bench.gpu_report as package
from rag_lab.bench.gpu_report.common import (
    CHECK_FAILED_EXIT,
    INPUT_FAULT_EXIT,
    ROOT,
    Context,
    ReportError,
    StageCheckError,
)
from rag_lab.bench.gpu_report.document import assemble, run_stage
from rag_lab.bench.gpu_report.stages import STAGES
from rag_lab.bench.gpu_report.wheels import WheelError, download_wheels, install_wheels


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--stage", choices=[*STAGES, "all", "list"], help="run one stage, all, or list them")
    action.add_argument("--assemble", action="store_true", help="write --doc from the fragments in --out")
    action.add_argument("--wheels", metavar="DIR", help="download the wheels a bare GPU machine lacks into DIR")
    parser.add_argument("--out", default=None, help="folder of the stage fragments (<stage>.json / .md)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--quick", action="store_true", help="toy sizes (CI; on CPU the only sensible choice)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "generated" / "gpu_report.md"),
                        help="--assemble writes this")
    parser.add_argument("--wheels-dir", default=str(ROOT / ".whl"), help="wheels a stage installs first, if there")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed after)")
    parser.add_argument("--scale-rows", type=int, default=None, help="toy passages of the scale stages")
    args = parser.parse_args(argv)
    if (args.stage not in (None, "list") or args.assemble) and not args.out:
        parser.error("--out DIR is required to run a stage or to assemble")
    if args.scale_rows is not None and args.scale_rows < 100:
        parser.error("--scale-rows must be at least 100")
    return args


def list_stages() -> None:
    for s in STAGES.values():
        print(f"{s.name:<10} ~{s.minutes:g} min on one H100 (estimated)  {s.what} (scales: {s.scales})")
    print(f"all        ~{sum(s.minutes for s in STAGES.values()):g} min (on a GPU: one stage per 10-minute command)")


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

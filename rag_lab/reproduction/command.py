"""Reproduce seed 000's comparisons on the toy world end to end and write the report (docs/generated/reproduction.md).

    nice -n 10 python scripts/reproduce.py                      # every section, default budgets and seeds
    python scripts/reproduce.py --only table1 ablation --seeds 0 1 2   # some sections: report in <runs>/report
    python scripts/reproduce.py --quick                         # tiny budgets, small world: a smoke test
    python scripts/reproduce.py --report-only                   # rewrite the report from finished runs
    python scripts/reproduce.py --evidence docs/evidence/E      # ... and commit each finished run's summary
    python scripts/reproduce.py --from-evidence docs/evidence/E # rewrite the report (into E/report) from them alone
    python scripts/reproduce.py --from-evidence docs/evidence/reproduction --out docs/generated --check
                                                                # fail where a committed table differs

Every training run is its own process (`python scripts/train_*.py` with the environment `accelerate launch
--num_processes 1 --cpu` would set, so that a failed run's exit status is this script's) with its own folder
under --runs; a finished run (metrics.json there) is reused and an interrupted one is launched again with
train.resume=true (from its last checkpoint if it saved one; finished RLM warm-start stages are kept), so an
interrupted reproduction continues where it stopped. The report always covers every
finished run it finds, whichever sections this invocation ran. On an x86-64 host with AVX2 every run (and the toy LMs
built in this process) uses ATen's AVX2 kernels, as the committed evidence did, unless ATEN_CPU_CAPABILITY is set:
AVX-512 kernels round differently, and rows from two kernel sets are no pairs (rag_lab/reproduction/kernels.py).

A section is one module of rag_lab/reproduction/ (rag_lab/reproduction/sections.py says what it declares); the
sections below, in the order they run and appear in the report, are the ones found there. Times are on 2 CPU cores,
one torch thread per run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Optional

import torch

from rag_lab.reproduction.budgets import FULL, QUICK
from rag_lab.reproduction.evidence import read_meta
from rag_lab.reproduction.plan import Plan
from rag_lab.reproduction.report import write_report
from rag_lab.reproduction.sections import collect, execute, sections, select, write_evidence


def sections_help() -> str:
    """--help's list of the sections, each with its declared help, in order."""
    lines = ["Sections (--only):"]
    for name, section in sections().items():
        head = f"  {name:<10}" if len(name) < 10 else f"  {name}\n" + " " * 12
        lines.append(head + textwrap.fill(section.help, width=118, initial_indent=" " * 12,
                                          subsequent_indent=" " * 12, break_on_hyphens=False)[12:])
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=f"{__doc__}\n{sections_help()}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(sections()), default=list(sections()),
                        help="sections to run")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (quick: 0)")
    parser.add_argument("--hidden", nargs="+", type=int, default=None, help="ablation sizes; default 64 256 1024")
    parser.add_argument("--runs", type=Path, default=None, help="default runs/reproduce (quick: runs/reproduce-quick)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for reproduction.md and figures/ (default: docs/generated when every section "
                             "runs; <runs>/report with --quick or --only a part of them, <evidence>/report with "
                             "--from-evidence, so a partial report never replaces the committed one)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (default 1: the tiny models gain little from a second thread, and "
                             "two threads stall badly when another job holds a core)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs of a section at a time (each with --threads threads; a run that starts from another "
                             "run's output waits for it)")
    parser.add_argument("--quick", action="store_true", help="tiny budgets on a 300-passage world, for testing")
    parser.add_argument("--match", nargs="+", default=None, metavar="PATTERN",
                        help="launch only the planned runs whose folder under --runs matches one of these shell "
                             "patterns (e.g. 'generative/*-seed[34]': more seeds for some rows), and the runs they "
                             "start from; --list-runs shows the folders; the report still covers every finished run")
    parser.add_argument("--report-only", action="store_true", help="launch nothing; rewrite the report")
    parser.add_argument("--list-runs", action="store_true",
                        help="launch nothing; print every run the sections would launch, one JSON object per line "
                             "(section, script, config, out, overrides, finished), each run once, in launch order")
    parser.add_argument("--evidence", type=Path, default=None,
                        help="also write the summary of every finished run of the --only sections into this folder "
                             "(docs/evidence: committed)")
    parser.add_argument("--from-evidence", type=Path, default=None,
                        help="launch nothing; write the report from the summaries in this folder, not from --runs "
                             "(its seeds, budget and runs folder are the ones the summaries were written with)")
    parser.add_argument("--check", action="store_true",
                        help="with --from-evidence: write nothing; fail where a report in --out differs from what "
                             "the evidence gives")
    args = parser.parse_args(argv)
    if args.match and (args.report_only or args.from_evidence is not None):
        parser.error("--match picks runs to launch; --report-only / --from-evidence launch nothing")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be at least 1")
    if args.check and args.from_evidence is None:
        parser.error("--check compares the report with what --from-evidence gives: name the evidence folder")
    if args.from_evidence is not None:
        if args.evidence is not None:
            parser.error("--evidence writes summaries from run folders; --from-evidence reads them: give one")
        meta = read_meta(args.from_evidence)
        args.quick, args.report_only = meta["budget"] == "quick", True
        args.seeds, args.hidden, args.runs = meta["seeds"], meta["hidden"], Path(meta["runs"])
    budget = QUICK if args.quick else FULL
    args.seeds = args.seeds or list(budget.seeds)
    args.hidden = args.hidden or list(budget.hidden)
    args.runs = args.runs or Path("runs/reproduce-quick" if args.quick else "runs/reproduce")
    args.out = args.out or default_out(args)
    return args


def default_out(args: argparse.Namespace) -> Path:
    """docs/generated only for a full run of every section: a quick or partial run, or a report from a section's
    evidence, writes beside its runs or evidence, never over the committed report."""
    if args.from_evidence is not None:
        return args.from_evidence / "report"
    if args.quick or args.only != list(sections()):
        return args.runs / "report"
    return Path("docs/generated")


def main(argv=None) -> None:
    """scripts/reproduce.py, inside its `exit_on_fault` (a damaged metrics.json: 2, a full disk or read-only folder:
    5, one `error:` line): a run that failed ends this process with the run's status."""
    args = parse_args(argv)
    if args.list_runs:
        plan = Plan(args.runs, args.seeds, args.hidden, args.out, quick=args.quick)
        for line in planned_runs(plan, args.only, args.match):
            print(json.dumps(line))
        return
    try:
        reproduce(args, argv)
    except subprocess.CalledProcessError as exc:  # a run failed: it printed its own `error:` line above
        status = exc.returncode if exc.returncode in (2, 3, 4, 5) else 1
        out = next((a.split("=", 1)[1] for a in exc.cmd if str(a).startswith("train.output_dir=")), "?")
        print(f"error: the run in {out} failed with exit status {exc.returncode} (its own error is above); "
              "scripts/reproduce.py resumes it when run again", file=sys.stderr, flush=True)
        raise SystemExit(status) from None


def planned_runs(plan: Plan, names: list[str], match: Optional[list[str]] = None) -> list[dict]:
    """What `execute` would launch for the sections `names` (and `match`), without preparing or launching anything:
    the way to see a plan before hours of runs, and to compare two versions' plans (a run's folder and overrides are
    its identity)."""
    lines, seen = [], set()
    for name in names:
        for run in select(sections()[name].runs(plan), plan.runs, match):
            if run.out not in seen:
                seen.add(run.out)
                lines.append({"section": name, "script": run.script, "config": str(run.config), "out": str(run.out),
                              "overrides": list(run.overrides), "finished": run.metrics() is not None})
    return lines


def reproduce(args: argparse.Namespace, argv) -> None:
    started, load_before = time.time(), os.getloadavg()
    plan = Plan(args.runs, args.seeds, args.hidden, args.out, args.from_evidence, quick=args.quick)
    if args.match and not planned_runs(plan, args.only, args.match):
        raise SystemExit(f"error: --match {' '.join(args.match)}: no run that {' '.join(args.only)} plans has a folder "
                         f"under {args.runs} that matches (python scripts/reproduce.py --list-runs shows them)")
    if not args.report_only:
        tally = execute(plan, args.only, args.threads, args.jobs, args.match)
        niceness = os.nice(0)
        command = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        plan.log_invocation({
            "command": (f"nice -n {niceness} " if niceness else "") + f"python scripts/reproduce.py {command}".strip(),
            "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)), "sections": tally.seconds,
            "wall_seconds": round(time.time() - started, 1), "launched": tally.launched, "reused": tally.reused,
            "threads": args.threads, "jobs": args.jobs,
            "load": [round(load_before[0], 1), round(os.getloadavg()[0], 1)]})
    if args.from_evidence is not None:
        recorded = read_meta(args.from_evidence)
        machine, invocations = recorded["machine"], recorded["invocations"]
    else:
        machine, invocations = describe_machine(), plan.invocations()
    evidence = args.evidence or args.from_evidence
    meta = {"machine": machine, "seeds": args.seeds, "quick": args.quick, "runs": args.runs,
            "invocations": invocations, "evidence": evidence}
    results = collect(plan)
    if args.check:
        check_report(results, meta, args.out, args.from_evidence)
        return
    path = write_report(results, meta, args.out)
    if args.evidence is not None:
        written = write_evidence(plan, args.evidence, {
            "machine": machine, "seeds": args.seeds, "hidden": args.hidden, "runs": str(args.runs),
            "budget": "quick" if args.quick else "full", "invocations": invocations}, args.only)
        print(f"[reproduce] evidence: {written} runs in {args.evidence}", flush=True)
    print(f"[reproduce] report: {path} ({time.time() - started:.0f} s)", flush=True)


def check_report(results: dict, meta: dict, out: Path, evidence: Path) -> None:
    """Writes the report into a scratch folder and compares its markdown with `out`'s: a table edited by hand, or
    evidence changed without regenerating, ends the process with a line naming the file and the command."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = write_report(results, meta, out, into=Path(scratch)).read_text().splitlines()
    committed = out / "reproduction.md"
    found = committed.read_text().splitlines() if committed.is_file() else []
    if found != fresh:
        line = next((i for i, (a, b) in enumerate(zip(found, fresh)) if a != b), min(len(found), len(fresh)))
        first = (f"line {line + 1} is {found[line] if line < len(found) else '(the end)'!r}, the evidence gives "
                 f"{fresh[line] if line < len(fresh) else '(the end)'!r}")
        raise SystemExit(f"error: {committed}: differs from what {evidence} gives ({first[:400]}; regenerate it: "
                         f"python scripts/reproduce.py --from-evidence {evidence} --out {out})")
    print(f"[reproduce] {committed} is what {evidence} gives", flush=True)


def describe_machine() -> str:
    """CPU model, cores and torch version: steps/s in the report mean little without them."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"

"""Reproduce seed 000's comparisons on the toy world end to end and write the report (docs/reproduction.md).

    nice -n 10 python scripts/reproduce.py                      # every section, default budgets and seeds
    python scripts/reproduce.py --only table1 ablation --seeds 0 1 2
    python scripts/reproduce.py --quick                         # tiny budgets, small world: a smoke test
    python scripts/reproduce.py --report-only                   # rewrite the report from finished runs
    python scripts/reproduce.py --evidence docs/evidence        # ... and commit each finished run's summary
    python scripts/reproduce.py --from-evidence docs/evidence   # rewrite the report from those summaries alone
    python scripts/reproduce.py --from-evidence docs/evidence --check   # fail where a committed table differs

Sections (--only):
  table1    Algorithm 1 (paper Table 1): in-batch, stale, corrector, exhaustive, SNM, negative cache, Dynnibal,
            trainable cache, from three inits: random (no paper counterpart), LM-pretrained (the paper's T5: a
            tiny T5 trained by span corruption on the world's passages, scripts/pretrain_toy_lm.py) and
            retrieval-pretrained (its GTR: a tiny retriever first trained supervised, in-batch, on ANOTHER toy
            world, toy_seed=1, with other entities);
  table3    Algorithm 2 (paper Table 3): closed book, frozen retriever, corrector, exhaustive, all from one
            shared warm start (`warm_start.from_run`); EM on the three toy datasets, steps/s; and frozen /
            corrector / exhaustive from the paper's T5 retriever init (the world's toy T5, no retrieval warm start,
            the same reader): 21 runs with 3 seeds, 42 min with --jobs 2 on 2 cores;
  ablation  corrector hidden size (paper Table 2): steps/s and recall, random init;
  curves    recall and EM over training steps for stale, corrector and exhaustive (the table1/table3 runs);
  synthetic the Section 5.3 grid (scripts/synthetic_corrector.py; an existing results.json is reused);
  large_batches
            seed 002 (ContAccum) in its own regime: scripts/compare_batching.py with raw dot products at
            temperature 1 from the LM-pretrained init (the paper's BERT): its Table 1, the K x M sweep of its
            Figure 3 and the gradient-norm ratio per step of its Figure 5 (<out>/large_batches_raw_lm_*.md);
  dynnibal  seed 001 as its paper runs it, on a described world (6,000 passages, toy_seed 1) from the LM-pretrained
            init and a GTR-like one (the other described world's LM trained in-batch on its questions): uniform
            negatives, Dynnibal with the warm start / refresh / full-refresh schedule, Dynnibal "+0" (no re-encoding),
            SNM at Dynnibal's device memory, exhaustive (rag_lab/reproduction/dynnibal.py);
  generative
            seed 003 (Np Decoding) where titles cannot be copied, on a described world (6,000 passages, toy_seed 1)
            and its splits (scripts/make_toy_splits.py): vanilla decoding, BASE, ASYNC, CONTRA and the dual encoder;
            vanilla and BASE on 30% / 10% of the training questions and with a d 64 generator; seen and unseen
            (zero-shot) people; generator and CE encoder the world's span-corruption toy T5
            (rag_lab/reproduction/generative.py). About 5-10 min per run on one core, 39 runs with 3 seeds
            (26 of them took 2 h with --jobs 2).
  described seed 000's Table 1 in its regime: described worlds (the first tuned on, the others not),
            three inits (random; the world's span-corruption toy T5; a GTR-like one, another described world's toy
            T5 trained in-batch on its questions) and the paper's rows: in-batch, stale, corrector (CE and MSE),
            Dynnibal "+0" and scheduled, SNM, exhaustive, with the share of the stale -> exhaustive gap each closes
            (rag_lab/reproduction/described.py).
  corrector_regime
            the corrector fed as seed 000 feeds it, from the LM-pretrained init on two described worlds: stale,
            exhaustive and the corrector at today's subset (16 questions, top-4 + 1 uniform) and at the paper's
            proportions (16, top-8 + 8 uniform), where the corrector is also tried 10.7x D wide and with extra
            updates and a replay, beside SNM and the trainable cache; closure at R@1/5/20/100 within each feed
            (rag_lab/reproduction/corrector_regime.py). 60 runs of 5-40 min on one core, seed by seed.
  corrector_refresh
            the drift-aware refresh (the corrector re-embedding the buffer when its drift crosses a threshold)
            against exhaustive every 500 and 1,000 steps, on corrector_regime's worlds and paper feed, whose stale,
            exhaustive, SNM and corrector rows it reuses: the gap closed against the passages re-embedded
            (rag_lab/reproduction/corrector_refresh.py). 24 runs of 10-40 min on one core, seed by seed.

Cost on 2 CPU cores (estimated from single runs, one torch thread per run): table1 + ablation + curves with
the default 3 seeds about 35 min (a 300-step run is 40-70 s); table3 is dominated by the shared reader warm start
and by the RLM's in-loop evaluations, roughly 45-60 min more with configs/toy/rlm.yaml as of this writing; the
synthetic grid reuses docs/figures/synthetic/results.json (about 5 min when it has to be rerun).

Every training run is its own process (`python scripts/train_*.py` with the environment `accelerate launch
--num_processes 1 --cpu` would set, so that a failed run's exit status is this script's) with its own folder
under --runs; a finished run (metrics.json there) is reused and an interrupted one is launched again with
train.resume=true (from its last checkpoint if it saved one; finished RLM warm-start stages are kept), so an
interrupted reproduction continues where it stopped. The report always covers every
finished run it finds, whichever sections this invocation ran.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rag_lab.reproduction.budgets import FULL, QUICK
from rag_lab.reproduction.evidence import read_meta
from rag_lab.reproduction.plan import SECTIONS, Plan
from rag_lab.reproduction.report import write_report


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (quick: 0)")
    parser.add_argument("--hidden", nargs="+", type=int, default=None, help="ablation sizes; default 64 256 1024")
    parser.add_argument("--runs", type=Path, default=None, help="default runs/reproduce (quick: runs/reproduce-quick)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for reproduction.md and figures/ (default docs; quick: <runs>/report)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (default 1: the tiny models gain little from a second thread, and "
                             "two threads stall badly when another job holds a core)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs of a section at a time (each with --threads threads; a run that starts from another "
                             "run's output waits for it)")
    parser.add_argument("--quick", action="store_true", help="tiny budgets on a 300-passage world, for testing")
    parser.add_argument("--report-only", action="store_true", help="launch nothing; rewrite the report")
    parser.add_argument("--evidence", type=Path, default=None,
                        help="also write every finished run's summary into this folder (docs/evidence: committed)")
    parser.add_argument("--from-evidence", type=Path, default=None,
                        help="launch nothing; write the report from the summaries in this folder, not from --runs "
                             "(its seeds, budget and runs folder are the ones the summaries were written with)")
    parser.add_argument("--check", action="store_true",
                        help="with --from-evidence: write nothing; fail where a report in --out differs from what "
                             "the evidence gives")
    args = parser.parse_args(argv)
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
    args.budget = budget
    args.seeds = args.seeds or list(budget.seeds)
    args.hidden = args.hidden or list(budget.hidden)
    args.runs = args.runs or Path("runs/reproduce-quick" if args.quick else "runs/reproduce")
    args.out = args.out or (args.runs / "report" if args.quick else Path("docs"))
    return args


def main(argv=None) -> None:
    """scripts/reproduce.py, inside its `exit_on_fault` (a damaged metrics.json: 2, a full disk or read-only folder:
    5, one `error:` line): a run that failed ends this process with the run's status."""
    args = parse_args(argv)
    try:
        reproduce(args, argv)
    except subprocess.CalledProcessError as exc:  # a run failed: it printed its own `error:` line above
        status = exc.returncode if exc.returncode in (2, 3, 4, 5) else 1
        out = next((a.split("=", 1)[1] for a in exc.cmd if str(a).startswith("train.output_dir=")), "?")
        print(f"error: the run in {out} failed with exit status {exc.returncode} (its own error is above); "
              "scripts/reproduce.py resumes it when run again", file=sys.stderr, flush=True)
        raise SystemExit(status) from None


def reproduce(args: argparse.Namespace, argv) -> None:
    started, load_before = time.time(), os.getloadavg()
    plan = Plan(args.runs, args.budget, args.seeds, args.hidden, args.out, args.from_evidence)
    if not args.report_only:
        tally = plan.execute(args.only, args.threads, args.jobs)
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
    meta = {"machine": machine, "seeds": args.seeds, "budget": args.budget, "runs": args.runs,
            "invocations": invocations, "evidence": evidence}
    results = plan.collect()
    if args.check:
        check_report(results, meta, args.out, args.from_evidence)
        return
    path = write_report(results, meta, args.out)
    if args.evidence is not None:
        written = plan.write_evidence(args.evidence, {
            "machine": machine, "seeds": args.seeds, "hidden": args.hidden, "runs": str(args.runs),
            "budget": "quick" if args.quick else "full", "invocations": invocations})
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

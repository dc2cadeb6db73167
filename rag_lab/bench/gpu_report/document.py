"""A stage's fragment (`<stage>.json` + `<stage>.md`) and the document assembled from the fragments
(docs/generated/gpu_report.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rag_lab.bench.gpu_report.common import Context, ReportError, environment
from rag_lab.bench.gpu_report.stages import STAGES
from rag_lab.bench.gpu_report.wheels import GPU_PYTHON, STAGE_WHEELS, wheel_requirements


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
    from rag_lab.bench.machine import synchronize

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
        "The reply's `files_at` folder holds the stage's two files: copy them into `docs/generated/gpu_report/` "
        "(replacing that stage's CPU fragments) and assemble this page from whatever is there (a stage with no "
        "fragment is listed as missing):", "",
        "```bash", "python scripts/gpu_report.py --assemble --out docs/generated/gpu_report", "```", "",
        "`--stage list` prints the stages with their expected minutes; `--stage all` runs them one after another "
        "(longer than one 10-minute command on a GPU); `--device cpu --quick --stage all` runs every stage at toy "
        "size with one torch thread (`tests/test_gpu_report.py`; the fragments under `docs/generated/gpu_report/` came "
        "from `--device cpu --quick --stage all --out docs/generated/gpu_report`). If `scale` outruns its limit, a "
        "second call on the still-warm machine with the same `--work` reuses the world the first one generated and "
        "indexed (those two rows then read 'not measured'), or `--scale-rows` makes the world smaller "
        "(generation, indexing and the "
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
             f"`{fragments.as_posix()}` (rag_lab/bench/gpu_report/); each stage times the code users run.", ""]
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

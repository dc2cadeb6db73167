"""The `scale` stage: the main job (`train_rlm`) end to end on a toy world of millions of passages, projected to
the paper's 28M."""

from __future__ import annotations

import os
import shutil
import time
from typing import Optional

from rag_lab.bench.gpu_report.common import ROOT, Context, Stage, gemm_peak, register

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
    return run_scale(ctx, SCALE_QUICK if ctx.quick else SCALE_GPU, SCALE_QUICK_ROWS if ctx.quick else SCALE_GPU_ROWS)


def run_scale(ctx: Context, cfg: dict, default_rows: int) -> dict:
    """`train_rlm` through the corrector with `cfg`'s steps, threads and overrides on a world of `--scale-rows` (or
    `default_rows`) passages built from scratch in `ctx.work`: the record of a scale stage."""
    import torch

    from rag_lab.bench import scale
    from rag_lab.bench.rlm_step import accelerate_device
    from rag_train.config import DataConfig, load_config
    from rag_train.data.corpus import Corpus
    from rag_train.data.toy_files import ensure_toy_world
    from rag_train.train.schema import RLMConfig

    rows = ctx.scale_rows or default_rows
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
    passages = {p["reason"]: p["seconds"] for p in run["corpus_passes"]}
    phases, loop = run["phase_seconds"], run["loop_seconds"] or 0.0
    search = run["loop_host_seconds"].get("buffer search", 0.0)
    tokens = passages.get("token cache build", 0.0)  # the corpus tokenised once (buffer/tokens.py)
    build = passages.get("stale buffer build", 0.0)
    final_pass = passages.get("final evaluation", 0.0)
    final = phases.get("final evaluation", 0.0)
    return {
        "generate": None if generate_s is None else generate_s * factor,
        "index": None if index_s is None else index_s * factor,
        "warm starts and setup": max(0.0, run["wall_seconds"] - tokens - build - loop - final),
        "token cache build": tokens * factor,
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
    tokens = passes.get("token cache build")  # absent from runs before the token cache
    lines = [f"`train_rlm` (the main job, configs/toy/rlm.yaml with the overrides below) on a {r['rows']:,}-passage "
             f"toy world built from scratch (passages rendered in {s['world_workers']} process(es)), {s['steps']} "
             "Algorithm-2 steps through the corrector (retriever gate "
             f"open from step 0), then the final evaluation (rag_lab/bench/scale.py). Overrides: "
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
             *([f"| token cache build (the corpus tokenised once) | {tokens['seconds']:.1f} s | "
                f"{rate(tokens['rows'], tokens['seconds'])} | | {proj['token cache build'] / 60:.1f} min |"]
               if tokens and "token cache build" in proj else []),
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


STAGE = register(Stage(
    name="scale", order=50, minutes=8,
    what=("train_rlm end to end on a toy world built from scratch (GPU: 5M passages), 28M projected"),
    run=stage_scale, render=render_scale,
    scales="generation, indexing and the corpus passes linear in --scale-rows"))

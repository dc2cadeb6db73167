"""The `step` stage: `RLMRecipe.train_step` at base size, 1 and 4 questions (rag_lab/bench/rlm_step.py)."""

from __future__ import annotations

import gc

from rag_lab.bench.gpu_report.common import Context, Stage, StageCheckError, gemm_peak, register

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

    from rag_lab.bench import rlm_step

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
    lines = [f"`RLMRecipe.train_step` itself (rag_lab/bench/rlm_step.py), random weights: reader shaped like "
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


STAGE = register(Stage(
    name="step", order=40, minutes=2,
    what=("RLMRecipe.train_step (GPU: base size, FiD 32 x 256 + GTR-base), 1 and 4 questions"),
    run=stage_step, render=render_step,
    scales="time linear in the steps timed; memory in questions x passages x tokens"))

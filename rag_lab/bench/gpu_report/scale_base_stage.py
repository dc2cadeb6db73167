"""The `scale_base` stage: the `scale` stage's main job with T5-base-shaped towers and reader, projected to 28M the same
way. Random init: what a step, a corpus pass and the search cost at base size is what is measured, not what is
learned; the passages and questions are the toy world's (short: the lengths are its own)."""

from __future__ import annotations

from rag_lab.bench.gpu_report.common import Context, Stage, register
from rag_lab.bench.gpu_report.scale_stage import SCALE_QUICK, TARGET_ROWS, render_scale, run_scale

BASE_SHAPE = {"d_model": 768, "d_ff": 3072, "d_kv": 64, "num_heads": 12, "num_layers": 12}  # T5-base
SCALE_BASE_GPU_ROWS, SCALE_BASE_QUICK_ROWS = 500_000, 300
SCALE_BASE_GPU = {"steps": 50, "threads": 0, "overrides": [
    *(f"retriever.tiny.{key}={value}" for key, value in BASE_SHAPE.items()),
    *(f"reader.tiny.{key}={value}" for key, value in BASE_SHAPE.items()), "reader.tiny.num_decoder_layers=12",
    "strategy.corrector.hidden=8192",  # the search stage's h for D = 768
    "buffer.embed_workers=8", "buffer.embed_batch_size=1024", "buffer.chunk_rows=262144",
    "warm_start.reader_steps=100", "warm_start.reader_copy_steps=50", "pdist_gate=0", "train.log_every=10"]}
# CPU quick: the scale stage's tiny shapes on a smaller world, fewer steps (tests/test_gpu_report.py runs both)
_QUICK_CHANGES = {"warm_start.reader_steps": 1, "warm_start.retriever_steps": 1, "data.max_train_examples": 20,
                  "data.max_eval_examples": 4}
SCALE_BASE_QUICK = {"steps": 2, "threads": 1, "overrides": [
    *(item for item in SCALE_QUICK["overrides"] if item.split("=")[0] not in _QUICK_CHANGES),
    *(f"{key}={value}" for key, value in _QUICK_CHANGES.items())]}


def stage_scale_base(ctx: Context) -> dict:
    return run_scale(ctx, SCALE_BASE_QUICK if ctx.quick else SCALE_BASE_GPU,
                     SCALE_BASE_QUICK_ROWS if ctx.quick else SCALE_BASE_GPU_ROWS)


def render_scale_base(record: dict) -> list[str]:
    shapes = ("tiny shapes (`--quick`)" if record["quick"] else
              f"T5-base shapes, random init: d_model {BASE_SHAPE['d_model']}, {BASE_SHAPE['num_heads']} heads, d_ff "
              f"{BASE_SHAPE['d_ff']}, {BASE_SHAPE['num_layers']} layers per tower and per reader stack")
    return [f"Towers and reader at {shapes}; the toy world's vocabulary and passage lengths.", "",
            *render_scale(record)]


STAGE = register(Stage(
    name="scale_base", order=55, minutes=6,
    what=(f"train_rlm with T5-base-shaped towers and reader (GPU: {SCALE_BASE_GPU_ROWS:,} passages), "
          f"{TARGET_ROWS // 1_000_000}M projected"),
    run=stage_scale_base, render=render_scale_base,
    scales="generation, indexing and the corpus passes linear in --scale-rows; a step grows with the models"))

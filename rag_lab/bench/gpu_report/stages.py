"""The report's stages, in the order they run and appear."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rag_lab.bench.gpu_report.common import Context
from rag_lab.bench.gpu_report.embed_stage import render_embed, stage_embed
from rag_lab.bench.gpu_report.forward_stage import render_forward, stage_forward
from rag_lab.bench.gpu_report.scale_stage import render_scale, stage_scale
from rag_lab.bench.gpu_report.search_stage import render_search, stage_search
from rag_lab.bench.gpu_report.step_stage import render_step, stage_step


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

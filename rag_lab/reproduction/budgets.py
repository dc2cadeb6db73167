"""The budget every section of the reproduction (scripts/reproduce.py) shares: the toy world's size, its LM, the seeds
and the ablation's corrector sizes, in full (the report in docs/ was made with them) and quick (a smoke test in CI).
Each section declares its own budget beside its runs (`Section.full`, `Section.quick`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Budget:
    """What more than one section reads; the seeds and corrector sizes are the defaults of --seeds and --hidden."""

    lm: tuple[str, ...]  # every T5 stand-in: span corruption on its world's passages (configs/toy/lm.yaml)
    seeds: tuple[int, ...]
    hidden: tuple[int, ...]  # corrector sizes of the ablation
    toy_passages: Optional[int] = None  # None: the configs' world (3,000 passages in data/toy)


FULL = Budget(lm=(), seeds=(0, 1, 2), hidden=(64, 256, 1024))
QUICK = Budget(lm=("steps=6", "batch_size=8", "warmup_steps=2"), seeds=(0,), hidden=(64, 256), toy_passages=300)

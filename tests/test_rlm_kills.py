"""SIGKILL at a point of every stage of the RLM (retriever warm start, reader warm start, stale-buffer build,
training before and after its first checkpoint), then train.resume=true: metrics (evaluation history included)
and every weight of reader and retriever equal the straight run's, bitwise on CPU. Each stage draws from its own
seed (`train.step.seed_stage`), so a stage reused from disk leaves the next one where a straight run would.
One test per kill point (tests/dist/rlm_faulty.py); docs/reliability.md lists them."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

import rag_train.train.rlm as rlm

from test_faults import ROOT, forked, results
from test_train_rlm import CONFIG, config, overrides, weights

FAULTY = ROOT / "tests" / "dist" / "rlm_faulty.py"
# a checkpoint and an evaluation every 2 of the 4 steps; warm starts of 2 steps each (test_train_rlm's settings)
EXTRA = {"train.save_every": 2, "train.eval_every": 2}
KILL_POINTS = ["kill:warm_retriever:1", "kill:warm_reader:1", "kill:buffer", "kill:step:1", "kill:step:3"]


@pytest.fixture(scope="module")
def straight(recipe_toy_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("straight") / "run"
    return out, rlm.train_rlm(config(recipe_toy_dir, out, "corrector", **EXTRA))


@pytest.mark.slow
@pytest.mark.parametrize("fault", KILL_POINTS)
def test_killed_in_any_stage_resumes_to_the_straight_run(recipe_toy_dir, tmp_path, straight, zygote, fault):
    out = tmp_path / "run"
    proc = forked(zygote, FAULTY, ["--config", CONFIG, *overrides(recipe_toy_dir, out, "corrector", **EXTRA)], fault,
                  tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not (out / "metrics.json").exists() and not (out / "reader").exists()
    resumed = rlm.train_rlm(config(recipe_toy_dir, out, "corrector", **EXTRA, **{"train.resume": "true"}))
    assert results(resumed) == results(straight[1])
    a, b = weights(straight[0]), weights(out)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key

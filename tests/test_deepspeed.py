"""Algorithm 2 under DeepSpeed ZeRO-2 and ZeRO-3 (configs/accelerate/deepspeed_zero{2,3}.yaml), 2 CPU processes
over gloo, on the 300-passage toy world: the run finishes, the saved reader and retriever load, ZeRO-2 gives the
losses of DDP, and a ZeRO-3 run stopped and resumed gives them too.

Same data and steps as a DDP run (`--multi_gpu`); train.max_grad_norm=0 because DeepSpeed clips over all
parameters, the corrector's included, where the DDP path leaves the corrector out of the clipping norm.
Asserted on CPU: ZeRO-2 bitwise equal to DDP (every logged loss, every saved weight); ZeRO-3 (stopped at step
2, resumed) within 1e-4 relative on the losses and 1e-4 absolute on the weights (its gathers and
reduce-scatters sum in another order). On GPUs ZeRO-2 gets the ZeRO-3 tolerances (NCCL and cuBLAS reduce in
other orders). The measured differences are printed (`-s`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")

from rag_train.launch import launch_command
from rag_train.train.run_dir import LOGS

from test_train_rlm import CONFIG, ROOT, STEPS, TOP_K, overrides, weights

# one xdist worker runs the whole file: the DDP reference runs once, in the module fixture
pytestmark = pytest.mark.xdist_group("test_deepspeed")

SCRIPT = ROOT / "scripts" / "train_rlm.py"
LOSSES = ("reader_loss", "retriever_loss", "corrector_loss")
# every part trained at every step: where a part has no gradient (the retriever before its gate opens) DeepSpeed
# still applies AdamW with a zero gradient while DDP leaves the part untouched
SAME = {"train.max_grad_norm": 0.0, "train.tracker": "tensorboard", "train.save_every": 2}


def deepspeed_command(stage: int, *args) -> list[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "configs" / "accelerate" / f"deepspeed_zero{stage}.yaml"), "--num_processes", "2",
            "--main_process_port", str(port), str(SCRIPT), *map(str, args)]


def run(cmd: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]  # the root cause
    assert proc.returncode == 0, "\n".join(errors[:10]) + proc.stderr[-3000:]


def train(toy_dir: Path, out: Path, stage: int | None, steps: int = STEPS, **extra) -> dict:
    args = ["--config", CONFIG, *overrides(toy_dir, out, "corrector", steps=steps, **{**SAME, **extra})]
    run(launch_command(SCRIPT, *args, processes=2) if stage is None else deepspeed_command(stage, *args))
    return json.loads((out / "metrics.json").read_text())


def logged_losses(run_dir: Path) -> dict[str, dict[int, float]]:
    """{loss name: {step: value}} from the run's tensorboard files (a resumed run writes a second file)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {name: {} for name in LOSSES}
    for events in sorted((run_dir / LOGS / "rlm").glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for name in LOSSES:
            if name in accumulator.Tags()["scalars"]:
                found[name].update({s.step: s.value for s in accumulator.Scalars(name)})
    return found


BITWISE_ON_THIS_MACHINE = not torch.cuda.is_available()  # gloo on CPU sums in the same order as DDP


def assert_finished_and_loadable(run_dir: Path, metrics: dict, reference: dict[str, torch.Tensor],
                                 exact: bool = False) -> None:
    from transformers import T5ForConditionalGeneration

    assert metrics["steps"] == STEPS and metrics["skipped_steps"] == 0 and metrics["strategy"] == "corrector"
    assert all(0 <= v <= 1 for v in metrics[f"answer_recall@{TOP_K}"].values())
    T5ForConditionalGeneration.from_pretrained(run_dir / "reader")  # a saved reader loads as plain T5
    saved = weights(run_dir)  # reader safetensors + DualEncoder.load of the retriever
    assert saved.keys() == reference.keys()
    worst = max(float((value.double() - reference[key].double()).abs().max()) for key, value in saved.items())
    print(f"{run_dir.name}: max |weight - DDP weight| = {worst:.3g}")
    for key, value in saved.items():  # full (gathered) weights, equal or close to the DDP run's
        assert value.shape == reference[key].shape and torch.isfinite(value).all(), key
        if exact:
            assert torch.equal(value, reference[key]), key
        else:
            torch.testing.assert_close(value, reference[key], rtol=0, atol=1e-4, msg=key)


@pytest.fixture(scope="module")
def ddp(recipe_toy_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "run"
    train(recipe_toy_dir, out, None)
    return out


def assert_same_losses(run_dir: Path, reference_dir: Path, exact: bool = False) -> None:
    got, expected = logged_losses(run_dir), logged_losses(reference_dir)
    worst = max(abs(got[name][step] - value) / max(abs(value), 1e-12)
                for name in LOSSES for step, value in expected[name].items() if step in got[name])
    print(f"{run_dir.name}: max relative |loss - DDP loss| = {worst:.3g}")
    for name in LOSSES:
        assert sorted(got[name]) == sorted(expected[name]) == list(range(1, STEPS + 1)), (name, sorted(got[name]))
        for step, value in expected[name].items():
            if exact:
                assert got[name][step] == value, (name, step)
            else:
                assert got[name][step] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, step)


@pytest.mark.slow
def test_zero2_matches_ddp(recipe_toy_dir, tmp_path, ddp):
    out = tmp_path / "zero2"
    metrics = train(recipe_toy_dir, out, 2)
    assert (out / "checkpoints" / "step-00000004" / "pytorch_model").is_dir()  # DeepSpeed's own checkpoint
    assert_finished_and_loadable(out, metrics, weights(ddp), exact=BITWISE_ON_THIS_MACHINE)
    assert_same_losses(out, ddp, exact=BITWISE_ON_THIS_MACHINE)


@pytest.mark.slow
def test_zero3_stopped_and_resumed_matches_ddp(recipe_toy_dir, tmp_path, ddp):
    out = tmp_path / "zero3"
    train(recipe_toy_dir, out, 3, steps=2)
    metrics = train(recipe_toy_dir, out, 3, **{"train.resume": "true"})
    assert_finished_and_loadable(out, metrics, weights(ddp))
    assert_same_losses(out, ddp)


def test_zero3_without_gathered_saving_is_refused(tmp_path):
    """ZeRO-3 without zero3_save_16bit_model could not save the trained models: refused before any work."""
    config = tmp_path / "zero3.yaml"
    text = (ROOT / "configs" / "accelerate" / "deepspeed_zero3.yaml").read_text()
    config.write_text(text.replace("zero3_save_16bit_model: true", "zero3_save_16bit_model: false"))
    cmd = deepspeed_command(3, "--config", CONFIG, f"train.output_dir={tmp_path / 'run'}")
    cmd[cmd.index("--config_file") + 1] = str(config)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "DeepSpeed ZeRO-3 needs zero3_save_16bit_model: true" in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()


FAULTY = '''
import sys
import rag_train.strategies.base as base
from rag_train.cli import parse_cli
from rag_train.train.schema import RetrieverTrainConfig
from rag_train.strategies.corrector import CorrectorStrategy
from rag_train.train.retriever import train_retriever

task_loss, auxiliary_loss, calls = base.Strategy.task_loss, CorrectorStrategy.auxiliary_loss, [0]

def nan_task_loss(self, scores, subset):  # step 2: NaN task loss
    calls[0] += 1
    loss, logged = task_loss(self, scores, subset)
    return loss * {2: float("nan")}.get(calls[0], 1.0), logged

def diverging(self, *args):  # steps 3 and 4: inf, then above strategy.corrector.max_loss
    return auxiliary_loss(self, *args) * {3: float("inf"), 4: 1e9}.get(calls[0], 1.0)

base.Strategy.task_loss, CorrectorStrategy.auxiliary_loss = nan_task_loss, diverging
train_retriever(parse_cli(RetrieverTrainConfig, sys.argv[1:]))
'''


@pytest.mark.slow
def test_zero2_guard_skips_bad_steps_and_drops_a_diverging_corrector(recipe_toy_dir, tmp_path):
    """Under DeepSpeed the step happens inside backward, so the guard decides on the losses: a NaN task loss
    skips the step (no backward), a non-finite or exploding corrector loss is left out of it (Algorithm 1)."""
    import test_train_retriever

    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    out = tmp_path / "run"
    args = test_train_retriever.overrides(recipe_toy_dir, out, "corrector", **{"strategy.corrector.max_loss": 1e6})
    cmd = deepspeed_command(2, "--config", test_train_retriever.CONFIG, *args)
    cmd[cmd.index(str(SCRIPT))] = str(script)
    run(cmd)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == test_train_retriever.STEPS
    assert metrics["skipped_steps"] == 1 and metrics["corrector_skipped_steps"] == 2
    assert all(torch.isfinite(value).all() for value in test_train_retriever.weights(out).values())

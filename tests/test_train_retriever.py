"""Algorithm 1 end to end on a 300-passage toy world: every strategy runs, metrics.json, the in-recipe loss
against a hand computation, resume = uninterrupted run, 2 processes = 1 process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_train.config import load_config
from rag_train.models.retriever import DualEncoder
from rag_train.strategies import REGISTRY
from rag_train.strategies import corrector as corrector_module
from rag_train.strategies.base import Strategy
from rag_train.train.curves import STRATEGY_PLOT
from rag_train.train.retriever import train_retriever
from rag_train.train.schema import RetrieverTrainConfig

from conftest import read_by

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "toy" / "retriever.yaml"
ALGORITHM_1 = [name for name, cls in REGISTRY.items() if 1 in cls.algorithms]
PASSAGES, STEPS, REFRESH, SNM_TARGETS, CACHE_REFRESH = 300, 6, 2, 50, 8
LANDMARKS, NYSTROM_SAMPLES = 8, 32  # dynnibal: re-encodes both every REFRESH steps


def overrides(toy_dir: Path, out: Path, name: str, steps: int = STEPS, **extra) -> list[str]:
    values = {**read_by(name, {
        "data.toy_dir": toy_dir, "data.toy_passages": PASSAGES, "data.max_eval_examples": 20,
        "data.max_train_examples": 200, "retriever.tiny.d_model": 32, "retriever.tiny.d_ff": 64,
        "retriever.tiny.d_kv": 8, "retriever.tiny.num_heads": 4, "retriever.tiny.num_layers": 1,
        "retriever.max_passage_length": 48, "train.output_dir": out, "train.steps": steps, "train.batch_size": 4,
        "train.tracker": "null", "train.eval_every": 0, "train.log_every": 1, "strategy.name": name,
        "strategy.top_k": 4, "strategy.uniform_negatives": 2, "strategy.refresh_every": REFRESH,
        "strategy.snm_targets": SNM_TARGETS, "strategy.cache_size": 32, "strategy.cache_refresh": CACHE_REFRESH,
        "strategy.landmarks": LANDMARKS, "strategy.nystrom_samples": NYSTROM_SAMPLES, "strategy.trees": 2,
        "strategy.mh_chains": 8, "strategy.corrector.hidden": 16, "buffer.shard_rows": 128,
        "buffer.embed_batch_size": 64, "eval.batch_size": 64})}
    if name == "dynnibal":  # from step 0 and without a full refresh, unless a test schedules them
        values.update({"strategy.warm_start_steps": 0, "strategy.full_refresh_step": 0})
    values.update(extra)
    return [f"{key}={value}" for key, value in values.items()]


def config(*args, **kwargs) -> RetrieverTrainConfig:
    return load_config(RetrieverTrainConfig, CONFIG, overrides(*args, **kwargs))


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return DualEncoder.load(run_dir / "retriever").state_dict()


def expected_reembedded(name: str) -> int:
    refreshes = STEPS // REFRESH
    return {"exhaustive": refreshes * PASSAGES, "snm": refreshes * SNM_TARGETS,
            "negative_cache": STEPS * CACHE_REFRESH, "dynnibal": refreshes * (LANDMARKS + NYSTROM_SAMPLES)}.get(name, 0)


@pytest.mark.parametrize("name", ALGORITHM_1)
def test_every_strategy_trains_and_writes_metrics(recipe_toy_dir, tmp_path, monkeypatch, name):
    recorded = []
    original = Strategy.task_loss

    def recording(self, scores, subset):
        loss, logged = original(self, scores, subset)
        recorded.append((scores.detach().double().numpy(), subset.positive_index.numpy(), loss.item(),
                         subset.rows.clone()))
        return loss, logged

    monkeypatch.setattr(Strategy, "task_loss", recording)
    tracked, tracking = [], corrector_module.tracking_values

    def tracking_recorded(*args):
        values = tracking(*args)
        tracked.append({key: value.item() for key, value in values.items()})
        return values

    monkeypatch.setattr(corrector_module, "tracking_values", tracking_recorded)
    cfg = config(recipe_toy_dir, tmp_path / "run", name)
    returned = train_retriever(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    # the in-loop drift as curves (train.log_every=1: every step) and their figure
    log = metrics["strategy_log"]
    if name == "corrector":
        assert log == {"step": list(range(1, STEPS + 1)), **{key: [t[key] for t in tracked] for key in tracked[0]}}
    assert (tmp_path / "run" / STRATEGY_PLOT).is_file() == bool(log)
    assert set(metrics["recall"]) == {"1", "5", "10", "20", "100"}
    recall = [metrics["recall"][k] for k in ("1", "5", "10", "20", "100")]
    assert all(0 <= r <= 1 for r in recall) and recall == sorted(recall)
    assert 0 <= metrics["mrr@10"] <= 1 and metrics["mrr@10"] >= recall[0] - 1e-12
    assert metrics["steps"] == STEPS and metrics["wall_seconds"] > 0 and metrics["strategy"] == name
    assert metrics["steps_per_second"] > 0
    assert metrics["reembedded_passages"] == expected_reembedded(name)
    assert returned["recall"] == metrics["recall"]
    initial = DualEncoder.from_config(cfg.retriever, tokenizer=str(recipe_toy_dir / "tokenizer"))
    assert DualEncoder.load(tmp_path / "run" / "retriever").fingerprint() != initial.fingerprint()  # it trained

    if name == "negative_cache":  # its own surrogate loss, tested in test_losses / test_strategies
        return
    assert len(recorded) == STEPS
    for scores, target, loss, rows in recorded:  # truncated softmax CE over the shared subset, beta = 1 / tau
        assert scores.shape == (4, len(rows)) and len(rows) >= 4
        logits = scores / cfg.train.temperature
        top = logits.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        hand = np.mean(log_z - logits[np.arange(len(target)), target])
        np.testing.assert_allclose(loss, hand, rtol=1e-5)


def test_history_starts_at_the_initial_model(recipe_toy_dir, tmp_path):
    """With train.eval_every, curves start at step 0 (before any update); the final evaluation is separate."""
    metrics = train_retriever(config(recipe_toy_dir, tmp_path / "run", "in_batch", steps=4, **{"train.eval_every": 2}))
    assert [entry["step"] for entry in metrics["history"]] == [0, 2]
    assert all("recall" in entry["retrieval"] for entry in metrics["history"])


def test_resume_reaches_the_uninterrupted_run(recipe_toy_dir, tmp_path):
    """6 steps in one go (saving at step 3) vs 3 steps, then train.resume=true to 6: same weights, same metrics."""
    extra = {"strategy.sampling": "gumbel", "train.warmup_steps": 4}  # generator and scheduler state matter
    whole = train_retriever(config(recipe_toy_dir, tmp_path / "whole", "corrector", **{"train.save_every": 3, **extra}))
    assert (tmp_path / "whole" / "checkpoints" / "step-00000003").is_dir()
    train_retriever(config(recipe_toy_dir, tmp_path / "split", "corrector", steps=3, **extra))
    resumed = train_retriever(config(recipe_toy_dir, tmp_path / "split", "corrector",
                                     **{"train.resume": "true", **extra}))
    assert resumed["steps"] == STEPS
    assert resumed["recall"] == whole["recall"] and resumed["mrr@10"] == whole["mrr@10"]
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "split")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bitwise on CPU
    with pytest.raises(ValueError, match="train.resume=true"):  # an existing run is never silently overwritten
        train_retriever(config(recipe_toy_dir, tmp_path / "split", "corrector", **extra))


TWO_PROCESS_NAMES = ("corrector", "dynnibal", "trainable_cache")


def two_process_runs(toy_dir: Path, out: Path) -> dict[str, list[str]]:
    """The runs `test_two_processes_match_one` compares, `two-NAME` under `out` (the launch: conftest's
    `two_process_retriever_runs`)."""
    return {f"two-{name}": overrides(toy_dir, out / f"two-{name}", name) for name in TWO_PROCESS_NAMES}


@pytest.mark.slow
@pytest.mark.xdist_group("retriever_runs")
def test_two_processes_match_one(recipe_toy_dir, tmp_path, two_process_retriever_runs):
    """Each strategy trained by two gloo processes (one `accelerate launch` runs them in turn, with the batching
    options of tests/test_batching.py: tests/dist/retriever_runs.py) against the same config on one process.
    dynnibal: the same MH samples on every process; trainable_cache: each process updates its shard of the cache by
    the gradient reduced over processes."""
    names, folder = TWO_PROCESS_NAMES, two_process_retriever_runs
    for name in names:
        two = json.loads((folder / f"two-{name}" / "metrics.json").read_text())
        one = train_retriever(config(recipe_toy_dir, tmp_path / f"one-{name}", name))
        assert two["steps"] == one["steps"] == STEPS and two["strategy"] == name
        for k, value in one["recall"].items():
            assert two["recall"][k] == pytest.approx(value, abs=1e-9), (name, k)
        assert two["mrr@10"] == pytest.approx(one["mrr@10"], abs=1e-6), name
        a, b = weights(tmp_path / f"one-{name}"), weights(folder / f"two-{name}")
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")


def test_evaluation_results_become_tracker_scalars():
    """One flattener for every recipe's evaluations (retriever, RLM, generative): nested recalls by cut-off,
    scalars as they are, the step and non-numbers left out."""
    from rag_train.train.run import flat_metrics

    entry = {"step": 7, "nq": {"em": 0.5, "questions": 20, "recall": {"1": 0.25, "5": 0.75}, "kind": "qa"},
             "dev": {"r_precision": 0.1}}
    assert flat_metrics(entry) == {"eval/nq/em": 0.5, "eval/nq/questions": 20, "eval/nq/recall@1": 0.25,
                                   "eval/nq/recall@5": 0.75, "eval/dev/r_precision": 0.1}

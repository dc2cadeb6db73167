"""The corrector fed more than seed 000 feeds it, and re-embedding when it stops tracking: the shared subset against a
brute-force union, the width as a multiple of D, extra updates and a replay that move h alone (the towers' gradients
as without them), the in-loop drift values by hand, and the drift-aware refresh (re-embeds exactly when its threshold
is crossed, counts what it re-embeds, resumes bit for bit after a kill)."""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_train.config import ConfigError
from rag_train.losses import retrieval_scores
from rag_train.strategies.corrector import WATCHABLE, CorrectorConfig, Pair, tracking_values
from rag_train.train.batching.base import StepParts, my_passages, subset_losses
from rag_train.train.curves import STRATEGY_PLOT
from rag_train.train.retriever import train_retriever
from rag_train.train.trainable import Trainable

from test_faults import EXTRA, ROOT, assert_same_run, config, forked
from test_strategies import (
    QUESTIONS,
    ROWS,
    brute_topk,
    fresh_embedding,
    make,
    perturb,
    queries_of,
    stale_matrix,
    world,  # noqa: F401 (the module's fixture)
)
from test_train_retriever import CONFIG, overrides

_spec = importlib.util.spec_from_file_location("drift_faulty", ROOT / "tests" / "dist" / "drift_faulty.py")
drift = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(drift)


def test_shared_subset_is_the_brute_force_union(world):
    """Algorithm 1's S: every question's top-k through h(B) + uniform rows per question + the positives, deduplicated,
    one softmax in which every question scores every row of the union with fresh vectors."""
    uniform, k = 3, 5
    strategy, model = make(world, "corrector", corrector=CorrectorConfig(hidden=12), uniform_negatives=uniform, top_k=k)
    perturb(strategy.corrector, scale=0.5, seed=43)
    queries, positives = queries_of(model), torch.tensor([4, 8, 8, 39])
    draws = torch.Generator().manual_seed(0)
    draws.set_state(strategy.generator.get_state())
    subset = strategy.subset(queries, positives)

    with torch.no_grad():
        top = brute_topk(queries, strategy.corrector(stale_matrix(world)), k)
    uniform_rows = torch.randint(ROWS, (uniform * len(positives),), generator=draws)
    union = sorted(set(top.reshape(-1).tolist()) | set(uniform_rows.tolist()) | set(positives.tolist()))
    assert subset.rows.tolist() == union and len(union) < k * len(positives) + uniform * len(positives) + 4
    assert torch.equal(subset.rows[subset.positive_index], positives)

    scored, task_loss = {}, strategy.task_loss

    def recording(scores, subset):
        scored["scores"] = scores.detach()
        return task_loss(scores, subset)

    strategy.task_loss = recording
    parts = StepParts(world["accelerator"], Trainable(retriever=model, **strategy.modules()), model, strategy,
                      world["corpus"], 0.5)
    with torch.no_grad():
        subset_losses(parts.trainable, parts, QUESTIONS, my_passages(parts, subset), subset)
    expected = queries_of(model) @ fresh_embedding(model, world["corpus"], union).T
    assert scored["scores"].shape == (len(QUESTIONS), len(union))
    torch.testing.assert_close(scored["scores"], expected, rtol=1e-5, atol=1e-5)


def test_hidden_multiple_sets_the_width_from_the_buffer_dimension(world):
    strategy, _ = make(world, "corrector", corrector=CorrectorConfig(hidden=12, hidden_multiple=2.5))
    assert strategy.corrector.hidden == round(2.5 * strategy.buffer.dim) and strategy.buffer.dim > 0
    assert CorrectorConfig(hidden=12).width(strategy.buffer.dim) == 12  # 0: `hidden` as written
    for key, value in [("hidden_multiple", -1.0), ("updates", 0), ("replay_steps", -1), ("refresh_below", 1.5),
                       ("refresh_window", 0), ("refresh_watch", "loss")]:
        with pytest.raises(ConfigError, match=f"strategy.corrector.{key}"):
            CorrectorConfig(**{key: value})
    with pytest.raises(ConfigError, match="rounds to 0"):
        CorrectorConfig(hidden_multiple=0.001).width(32)


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_extra_updates_and_replay_move_only_the_corrector(world, loss):
    """Three steps as the recipe drives them (fresh vectors and scores passed with their graph): the towers' gradient
    of task + corrector loss, the replayed steps' pairs included, is bitwise the task loss's alone, and the updates
    after the optimizer step change h and nothing else."""
    own = CorrectorConfig(hidden=12, loss=loss, updates=3, replay_steps=2, lr=1e-2)
    strategy, model = make(world, "corrector", corrector=own, uniform_negatives=2)
    perturb(strategy.corrector, scale=0.2, seed=51)
    towers = [p for p in model.parameters() if p.requires_grad]
    corrector = list(strategy.corrector.parameters())
    for step in range(1, 4):
        subset = strategy.subset(queries_of(model), torch.tensor([1, 2, 3, 4]))
        model.train()
        queries, passages = model(QUESTIONS, world["corpus"].passages(subset.rows.tolist()))
        scores = queries @ passages.T
        task, _ = strategy.task_loss(scores, subset)
        alone = torch.autograd.grad(task, towers, retain_graph=True)
        aux = strategy.auxiliary_loss(queries.detach(), subset.rows, passages, scores)
        assert [s for s, _ in strategy.replay] == list(range(max(1, step - 2), step))  # the last 2 steps joined
        both = torch.autograd.grad(task + aux, towers + corrector)
        assert all(torch.equal(a, b) for a, b in zip(alone, both))
        assert all(g.any() for g in both[len(towers):])  # h does get a gradient

        before = [p.detach().clone() for p in towers + corrector]
        strategy.after_step(step)
        assert all(torch.equal(a, p) for a, p in zip(before, towers))
        assert all(not torch.equal(a, p) for a, p in zip(before[len(towers):], corrector))
        assert all(p.grad is None for p in towers + corrector)
        perturb(model, seed=step)  # the encoders move between steps (the recipe's optimizer)


def test_replay_on_per_question_rows_is_the_mean_over_the_kept_steps(world):
    """Algorithm 2's rows [B, k]: the loss with a replay of 1 step is the weighted mean of this step's loss and the
    kept step's (h's loss on that step's pair, recomputed with h as it is now); the extra update moves h."""
    own = CorrectorConfig(hidden=12, updates=2, replay_steps=1, weight=3.0)
    strategy, _ = make(world, "corrector", corrector=own)
    perturb(strategy.corrector, scale=0.2, seed=52)  # W2 != 0: every parameter of h has a gradient
    gen = torch.Generator().manual_seed(5)
    dim = strategy.buffer.dim
    pairs = [(torch.randn(4, dim, generator=gen), torch.randint(ROWS, (4, 3), generator=gen),
              torch.randn(4, 3, dim, generator=gen)) for _ in range(3)]
    for step, (queries, rows, fresh) in enumerate(pairs, 1):
        aux = strategy.auxiliary_loss(queries, rows, fresh, torch.einsum("bd,bsd->bs", queries, fresh))
        with torch.no_grad():
            alone = [strategy.pair_loss(Pair(*pairs[i]))[0] for i in range(max(0, step - 2), step)]
        torch.testing.assert_close(aux.detach(), 3.0 * torch.stack(alone).mean())
        before = [p.detach().clone() for p in strategy.corrector.parameters()]
        strategy.after_step(step)
        assert all(not torch.equal(a, p) for a, p in zip(before, strategy.corrector.parameters()))
        assert [s for s, _ in strategy.replay] == [step]


def test_tracking_values_match_a_hand_computation():
    """cos(B[y], g(y)) and cos(h(B[y]), g(y)) averaged over rows, and each question's top-4 overlap of
    <f(x), h(B[y])> with <f(x), g(y)>, for Algorithm 1's shared subset [S, D] and Algorithm 2's per question
    [B, k, D]."""
    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(3, 8, generator=gen)

    def cosine(a, b):
        a, b = a.double().numpy().reshape(-1, 8), b.double().numpy().reshape(-1, 8)
        return np.mean((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))

    for shape in [(10, 8), (3, 10, 8)]:
        stale, corrected, fresh = (torch.randn(*shape, generator=gen) for _ in range(3))
        fresh_scores, corrected_scores = (retrieval_scores(queries, vectors) for vectors in (fresh, corrected))
        values = tracking_values(stale, corrected, fresh, corrected_scores, fresh_scores)
        overlap = np.mean([len(set(np.argsort(-f)[:4]) & set(np.argsort(-c)[:4])) / 4
                           for f, c in zip(fresh_scores.numpy(), corrected_scores.numpy())])
        assert values["corrector/cos_stale"].item() == pytest.approx(cosine(stale, fresh), abs=1e-6)
        assert values["corrector/cos_corrected"].item() == pytest.approx(cosine(corrected, fresh), abs=1e-6)
        assert values["corrector/subset_overlap@4"].item() == pytest.approx(overlap, abs=1e-7)  # float32


@pytest.mark.parametrize("watch", WATCHABLE)
def test_refresh_policy_re_embeds_when_the_windowed_value_falls_below(world, tmp_path, watch):
    """Window 2, threshold 0.5, the watched value scripted per step (the other tracked values stay at 0.95): re-embedded
    after steps 4 and 7 only (window means 0.35 and 0.15; 0.55 at step 6 is not below), with the encoder of that
    moment, counted; h back to the identity; search and h's input read the re-embedded buffer; the state survives a
    checkpoint."""
    own = CorrectorConfig(hidden=12, refresh_below=0.5, refresh_window=2, standardize=True, refresh_watch=watch)
    strategy, model = make(world, "corrector", corrector=own)
    perturb(strategy.corrector, scale=0.5, seed=44)
    overlaps = [0.9, 0.8, 0.4, 0.3, 0.9, 0.2, 0.1, 0.6]
    stale, vectors = stale_matrix(world), strategy.vectors.clone()
    for step, value in enumerate(overlaps, 1):
        perturb(model, seed=100 + step)
        strategy.tracked = {f"corrector/{key}": torch.tensor(value if key == watch else 0.95) for key in WATCHABLE}
        strategy.trained = True  # as `auxiliary_loss` leaves it
        strategy.after_step(step)
        if step not in (4, 7):
            assert torch.equal(strategy.vectors, vectors)
            continue
        fresh = fresh_embedding(model, world["corpus"], range(ROWS))
        torch.testing.assert_close(strategy.vectors, fresh, rtol=1e-5, atol=1e-5)
        vectors = strategy.vectors.clone()
        assert not strategy.corrector.second.weight.any() and not strategy.corrector.second.bias.any()  # identity
        torch.testing.assert_close(strategy.corrector.input_mean.double(), vectors.double().mean(0))
        assert torch.equal(strategy.stale_vectors(torch.tensor([[3, 5]])), vectors[[3, 5]][None])
        queries = queries_of(model)
        assert torch.equal(strategy.retrieve(queries, 5), brute_topk(queries, vectors, 5))
    assert not torch.allclose(vectors, stale, atol=1e-3)
    assert strategy.refresh_steps == [4, 7] and strategy.embedded == 2 * ROWS
    assert strategy.summary() == {"refresh_steps": [4, 7]}

    strategy.save(tmp_path)
    resumed, _ = make(world, "corrector", corrector=own)
    resumed.load(tmp_path)
    assert torch.equal(resumed.vectors, strategy.vectors) and torch.equal(resumed.refreshed, strategy.refreshed)
    assert (resumed.window, resumed.refresh_steps, resumed.embedded) == (strategy.window, [4, 7], 2 * ROWS)
    assert resumed.window == pytest.approx([0.6])


def test_refresh_policy_is_refused_where_it_cannot_follow(world):
    with pytest.raises(ConfigError, match="buffer.search=full"):
        make(world, "corrector", search="rerank", corrector=CorrectorConfig(hidden=12, refresh_below=0.5))


# -- the recipe: scripted drift, counted re-embedding, a kill and a resume -----------------------------------------

# h updated twice per step with a replay of 2 steps: their state (h's own optimizer, the replay) is resumed too
SETTINGS = {**drift.DRIFT_SETTINGS, "strategy.corrector.updates": 2, "strategy.corrector.replay_steps": 2}


@pytest.fixture(scope="module")
def scripted(recipe_toy_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("drift") / "run"
    with pytest.MonkeyPatch.context() as patch:
        drift.script_drift(patch.setattr)
        return out, train_retriever(config(recipe_toy_dir, out, **SETTINGS))


@pytest.mark.xdist_group("corrector_drift")  # one `scripted` run for both tests
def test_scripted_drift_re_embeds_at_its_crossings_and_counts_them(scripted):
    out, metrics = scripted
    assert metrics["strategy_summary"]["refresh_steps"] == drift.REFRESH_STEPS
    assert metrics["reembedded_passages"] == len(drift.REFRESH_STEPS) * 300  # the whole buffer each time
    log = json.loads((out / "metrics.json").read_text())["strategy_log"]
    assert log["step"] == list(range(1, len(drift.DRIFT) + 1))
    assert log["corrector/subset_overlap@4"] == pytest.approx(drift.DRIFT)
    assert {"corrector/cos_stale", "corrector/cos_corrected"} <= set(log)
    assert (out / STRATEGY_PLOT).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.xdist_group("corrector_drift")
def test_killed_with_the_refresh_resumes_bit_for_bit(recipe_toy_dir, tmp_path, scripted, zygote):
    """SIGKILL after step 5 (the last checkpoint, step 4, holds the buffer re-embedded after step 3, a half-full
    window, the replay and h's own optimizer); the resumed run re-embeds after step 5 as the straight one did."""
    out = tmp_path / "run"
    args = ["--config", CONFIG, *overrides(recipe_toy_dir, out, "corrector", **{**EXTRA, **SETTINGS})]
    proc = forked(zygote, ROOT / "tests" / "dist" / "drift_faulty.py", args, "kill:step:5", tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    with pytest.MonkeyPatch.context() as patch:
        drift.script_drift(patch.setattr)
        metrics = train_retriever(config(recipe_toy_dir, out, **SETTINGS, **{"train.resume": "true"}))
    assert_same_run(out, metrics, scripted)

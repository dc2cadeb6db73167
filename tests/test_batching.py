"""Algorithm 1's batching options (seed 002) against independent references, in float64 with dropout off:
GradCache = the full-batch gradient = sentence-transformers' CachedMultipleNegativesRankingLoss; ContAccum
with no bank = plain / GradAccum; the oracle-bank identity (and its failure for a passage-only bank); the
bank invariants; config checks; resume with banks; 2 processes = 1 process for every option."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from rag_train.config import BufferConfig, ConfigError, RetrieverConfig, TinyModelConfig
from rag_train.data.corpus import Corpus
from rag_train.data.supervised import load_retrieval
from rag_train.models.retriever import DualEncoder, format_passage
from rag_train.strategies import REGISTRY, StrategyConfig, StrategyContext
from rag_train.train.batching import REGISTRY as OPTIONS
from rag_train.train.batching import (
    BatchingConfig,
    BatchingOption,
    MicroBatch,
    StepParts,
    check_batching,
    register,
    tower_grad_norms,
)
from rag_train.train.batching.cont_accum import Banks
from rag_train.train.retriever import train_retriever
from rag_train.train.trainable import Trainable

from conftest import drop_in
from test_train_retriever import CONFIG, ROOT, config, overrides, weights

TEMPERATURE = 0.05  # sentence-transformers' scale 20


@pytest.fixture(scope="module")
def world(recipe_toy_dir):
    """The toy corpus and 8 training examples with distinct positives (no duplicate columns)."""
    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    picked, seen = [], set()
    for example in load_retrieval(recipe_toy_dir / "retrieval-train.jsonl", corpus=corpus):
        if example.positive_ids[0] not in seen:
            seen.add(example.positive_ids[0])
            picked.append(example)
        if len(picked) == 8:
            break
    return recipe_toy_dir, corpus, picked


def tiny_model(toy_dir: Path, shared: bool = False) -> DualEncoder:
    """A float64 tiny dual encoder without dropout (exactness needs the same function in every pass); a copy of one
    built once per session."""
    return copy.deepcopy(_tiny_model(toy_dir, shared))


@functools.lru_cache(maxsize=None)
def _tiny_model(toy_dir: Path, shared: bool) -> DualEncoder:
    cfg = RetrieverConfig(shared_towers=shared, max_query_length=128, max_passage_length=128,
                          tiny=TinyModelConfig(d_model=16, d_ff=32, d_kv=4, num_heads=2, num_layers=1))
    model = DualEncoder.from_config(cfg, tokenizer=str(toy_dir / "tokenizer"), seed=3).double()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "dropout", None), float):  # T5Attention's functional dropout
            module.dropout = 0.0
    return model


def step_parts(model: DualEncoder, corpus: Corpus, uniform: int = 0) -> StepParts:
    accelerator = Accelerator(cpu=True)
    strategy_cfg = StrategyConfig(name="in_batch", top_k=1, uniform_negatives=uniform)
    ctx = StrategyContext(accelerator, model, corpus, BufferConfig(), None, TEMPERATURE, seed=0)
    return StepParts(accelerator, Trainable(retriever=model), model, REGISTRY["in_batch"](strategy_cfg, ctx), corpus,
                     TEMPERATURE)


def micro_batches(corpus: Corpus, examples: list, count: int) -> list[MicroBatch]:
    rows = torch.as_tensor(corpus.rows([ex.positive_ids[0] for ex in examples]))
    size = len(examples) // count
    return [MicroBatch([ex.question for ex in examples[i : i + size]], rows[i : i + size])
            for i in range(0, len(examples), size)]


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def run_option(name: str, model: DualEncoder, corpus: Corpus, batches: list[MicroBatch], uniform: int = 0,
               **keys) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of option `name` on fresh strategy state: (loss, gradients)."""
    model.zero_grad(set_to_none=True)
    option = OPTIONS[name](BatchingConfig(name=name, micro_batches=len(batches), **keys),
                           step_parts(model, corpus, uniform))
    out = option.step(batches)
    if not out.backward_done:
        out.loss.backward()
    return out.loss.item(), gradients(model)


def assert_same(a: dict, b: dict, rtol: float = 1e-9, atol: float = 1e-12, scale: float = 1.0) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(a[key], b[key] * scale, rtol=rtol, atol=atol, msg=key)


# -- GradCache -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("uniform", [0, 2])
def test_grad_cache_is_the_full_batch_gradient(world, uniform):
    """K = 4 chunks of 2 vs one forward of 8 (plain), with and without uniform negatives in the subset."""
    toy_dir, corpus, examples = world
    model = tiny_model(toy_dir)
    full_loss, full = run_option("plain", model, corpus, micro_batches(corpus, examples, 1), uniform)
    cached_loss, cached = run_option("grad_cache", model, corpus, micro_batches(corpus, examples, 4), uniform)
    assert cached_loss == pytest.approx(full_loss, rel=1e-12)
    assert_same(cached, full)
    _, accumulated = run_option("grad_accum", model, corpus, micro_batches(corpus, examples, 4), uniform)
    assert max(float((accumulated[k] - full[k]).abs().max()) for k in full) > 1e-6  # GradAccum is not it


def test_grad_cache_replays_dropout(world):
    """Dropout on: each chunk's re-encoding must draw the masks of its no-gradient pass (RandContext). With one
    chunk those are the masks plain draws from the same RNG state, so the gradients agree; a re-encoding with
    fresh masks would not."""
    toy_dir, corpus, examples = world
    model = tiny_model(toy_dir)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.3
    whole = micro_batches(corpus, examples, 1)
    torch.manual_seed(11)
    plain_loss, plain = run_option("plain", model, corpus, whole)
    torch.manual_seed(11)
    cached_loss, cached = run_option("grad_cache", model, corpus, whole)
    assert cached_loss == pytest.approx(plain_loss, rel=1e-12)
    assert_same(cached, plain)
    torch.manual_seed(12)
    _, other_masks = run_option("plain", model, corpus, whole)
    assert max(float((other_masks[k] - plain[k]).abs().max()) for k in plain) > 1e-6  # the masks matter


def test_grad_cache_matches_sentence_transformers_cached_mnrl(world):
    """A reference written by others: sentence-transformers' GradCache loss (scale 20 = 1 / temperature 0.05,
    cosine similarity = dot product of our normalised vectors) on a shared-tower model."""
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    toy_dir, corpus, examples = world
    model = tiny_model(toy_dir, shared=True)
    tower = model.query_encoder
    tower.max_seq_length = 128
    ours_loss, ours = run_option("grad_cache", model, corpus, micro_batches(corpus, examples, 4))

    questions = [ex.question for ex in examples]
    rows = corpus.rows([ex.positive_ids[0] for ex in examples]).tolist()
    passages = [format_passage(p) for p in corpus.passages(rows)]
    reference = CachedMultipleNegativesRankingLoss(tower, scale=1 / TEMPERATURE, mini_batch_size=3)
    loss = reference([tower.preprocess(questions), tower.preprocess(passages)], None)
    loss.backward()
    theirs = {f"query_encoder.{k}": v for k, v in gradients(tower).items()}
    assert loss.item() == pytest.approx(ours_loss, rel=1e-10)
    assert_same(ours, theirs, rtol=1e-8, atol=1e-11)


# -- ContAccum ---------------------------------------------------------------------------------------------


def test_cont_accum_without_bank_is_plain_and_grad_accum(world):
    """M = 0, K = 1: plain in-batch, bitwise; M = 0, K = 4: GradAccum, bitwise (uniform negatives on, so the
    hard-negative bank is built and left empty)."""
    toy_dir, corpus, examples = world
    model = tiny_model(toy_dir)
    one = micro_batches(corpus, examples, 1)
    assert_same(run_option("cont_accum", model, corpus, one, uniform=2)[1],
                run_option("plain", model, corpus, one, uniform=2)[1], rtol=0, atol=0)
    four = micro_batches(corpus, examples, 4)
    assert_same(run_option("cont_accum", model, corpus, four, uniform=2)[1],
                run_option("grad_accum", model, corpus, four, uniform=2)[1], rtol=0, atol=0)


@pytest.mark.parametrize("bank_queries", [True, False])
def test_oracle_bank_identity(world, bank_queries):
    """When micro-batch k's banks hold the other chunks encoded with the current weights, each ContAccum loss is
    the full-batch loss and the summed gradients are the full-batch gradient / K. A passage-only bank (banked
    queries not loss rows) breaks it."""
    toy_dir, corpus, examples = world
    model = tiny_model(toy_dir)
    count, whole = 4, micro_batches(corpus, examples, 1)
    full_loss, full = run_option("plain", model, corpus, whole)
    parts = step_parts(model, corpus)
    with torch.no_grad():
        queries = model.encode_queries(whole[0].questions)
        positives = model.encode_passages(corpus.passages(whole[0].positives.tolist()))
    cfg = BatchingConfig(name="cont_accum", micro_batches=count, bank_size=len(examples), bank_queries=bank_queries,
                         bank_hard_negatives=False)
    size, losses = len(examples) // count, []
    for k, batch in enumerate(micro_batches(corpus, examples, count)):
        option = OPTIONS["cont_accum"](cfg, parts)
        others = [i for i in range(len(examples)) if not k * size <= i < (k + 1) * size]
        option.banks.enqueue(queries[others], positives[others], whole[0].positives[others])
        losses.append(option.micro_step(batch, 1.0 / count)["loss"].item())
    summed = gradients(model)
    if bank_queries:
        assert losses == pytest.approx([full_loss] * count, rel=1e-12)
        assert_same(summed, full, scale=1 / count)
        return
    assert max(abs(loss - full_loss) for loss in losses) > 1e-3
    gaps = [float((summed[k] - full[k] / count).abs().max() / full[k].abs().max()) for k in full]
    assert max(gaps) > 1e-2


def test_bank_invariants(world):
    """Over 3 steps of K = 2 micro-batches of 4 with M = 10 (frozen weights: no optimizer step): size
    min(t N, M) after t micro-batches, FIFO order, q / p / h slots of one triple each (each slot equals a fresh
    encoding of what its row names), no gradient, the same storage throughout."""
    toy_dir, corpus, examples = world
    model = tiny_model(toy_dir)
    parts = step_parts(model, corpus, uniform=3)
    option = OPTIONS["cont_accum"](BatchingConfig(name="cont_accum", micro_batches=2, bank_size=10), parts)
    storage = [t.data_ptr() for t in (option.banks.q, option.banks.p, option.banks.h)]
    sizes, seen = [], []
    batches = micro_batches(corpus, examples, 2)
    for _ in range(3):
        for batch in batches:
            option.step([batch])  # one micro-batch per call, so the size is read after each
            sizes.append(option.banks.size)
            seen.extend(zip(batch.questions, batch.positives.tolist()))
        model.zero_grad(set_to_none=True)
    assert sizes == [min(4 * t, 10) for t in range(1, 7)]
    assert [t.data_ptr() for t in (option.banks.q, option.banks.p, option.banks.h)] == storage
    banks = option.banks.ordered()
    expected = seen[-10:]  # the newest 10, oldest first
    assert banks["p_rows"].tolist() == [row for _, row in expected]
    with torch.no_grad():
        q = model.encode_queries([question for question, _ in expected])
        p = model.encode_passages(corpus.passages([row for _, row in expected]))
        h = model.encode_passages(corpus.passages(banks["h_rows"].tolist()))
    for name, fresh in (("q", q), ("p", p), ("h", h)):
        assert not banks[name].requires_grad and banks[name].grad_fn is None
        torch.testing.assert_close(banks[name], fresh, rtol=1e-9, atol=1e-12, msg=name)
    positives = set(batches[0].positives.tolist()) | set(batches[1].positives.tolist())
    assert not set(banks["h_rows"].tolist()) & positives and (banks["h_rows"] >= 0).all()


def test_without_past_encoders_each_step_starts_from_empty_banks(world):
    """bank_past_encoders=false (the paper's "w/o Past Enc."): with the weights unchanged, every step's loss is
    the one a ContAccum with fresh banks computes on the same micro-batches, and the banks then hold that step's
    triples only; with the default the second step reads the first step's vectors and its loss differs."""
    toy_dir, corpus, examples = world
    model = tiny_model(toy_dir)
    parts = step_parts(model, corpus)  # in-batch negatives only: no sampler whose draws differ between runs
    batches = micro_batches(corpus, examples, 2)

    def steps(past: bool, count: int) -> tuple[list[float], object]:
        option = OPTIONS["cont_accum"](BatchingConfig(name="cont_accum", micro_batches=2, bank_size=10,
                                                      bank_past_encoders=past), parts)
        losses = []
        for _ in range(count):
            losses.append(option.step(batches).loss.item())
            model.zero_grad(set_to_none=True)
        return losses, option

    default, _ = steps(True, 2)  # its first step is the one from fresh banks
    without, option = steps(False, 3)
    assert without == [default[0]] * 3
    assert option.banks.size == 8 and option.banks.ordered()["p_rows"].tolist() == \
        batches[0].positives.tolist() + batches[1].positives.tolist()
    assert abs(default[1] - default[0]) > 1e-4


@pytest.mark.parametrize("mask", [True, False])
def test_mask_false_negatives_hides_only_other_copies_of_the_rows_positive(world, mask):
    """Example 0 in both micro-batches of one step (bank_size 4, no hard-negative bank): in micro-batch 2 its fresh
    row meets its banked positive and its banked row meets its fresh positive. The loss is recomputed by hand from
    fresh encodings (weights unchanged: no optimizer step): with the mask those two copies leave the two rows'
    softmax (nothing else does), without it they stay in as negatives."""
    toy_dir, corpus, examples = world
    model = tiny_model(toy_dir)
    first, second = [examples[0], examples[1]], [examples[2], examples[0]]
    batches = [micro_batches(corpus, part, 1)[0] for part in (first, second)]
    option = OPTIONS["cont_accum"](BatchingConfig(name="cont_accum", micro_batches=2, bank_size=4,
                                                  bank_hard_negatives=False, mask_false_negatives=mask),
                                   step_parts(model, corpus))
    loss = option.step(batches).loss.item()

    def hand(rows: list, column_rows: list[int], labels: list[int], masked: bool) -> float:
        with torch.no_grad():
            q = model.encode_queries([ex.question for ex in rows])
            c = model.encode_passages(corpus.passages(column_rows))
        scores = q @ c.T
        positives = [corpus.rows([ex.positive_ids[0]])[0] for ex in rows]
        for i, label in enumerate(labels):
            for j, row in enumerate(column_rows):
                if masked and row == positives[i] and j != label:
                    scores[i, j] = float("-inf")
        return float(torch.nn.functional.cross_entropy(scores / TEMPERATURE, torch.tensor(labels)))

    def row(ex) -> int:
        return int(corpus.rows([ex.positive_ids[0]])[0])

    def step_loss(masked: bool) -> float:
        one = sorted({row(ex) for ex in first})  # the in-batch subset: the batch's positives, in row order
        two = sorted({row(ex) for ex in second})
        banked = [row(ex) for ex in first]  # bank columns after micro-batch 1, labels of its banked queries
        loss_one = hand(first, one, [one.index(row(ex)) for ex in first], masked)  # empty banks: nothing to mask
        loss_two = hand(second + first, two + banked, [two.index(row(ex)) for ex in second] + [len(two), len(two) + 1],
                        masked)
        return (loss_one + loss_two) / 2

    assert loss == pytest.approx(step_loss(mask), rel=1e-9)
    assert abs(step_loss(True) - step_loss(False)) > 1e-4


def test_tower_grad_norms_is_each_towers_whole_gradient(world):
    """The norms against the flattened gradients of each tower's parameters, after one ContAccum step; shared
    towers report nothing."""
    toy_dir, corpus, examples = world
    model = tiny_model(toy_dir)
    option = OPTIONS["cont_accum"](BatchingConfig(name="cont_accum", micro_batches=2, bank_size=4),
                                   step_parts(model, corpus))
    option.step(micro_batches(corpus, examples, 2))
    values = tower_grad_norms(model)

    def flat(tower: nn.Module) -> float:
        return float(torch.cat([p.grad.flatten() for p in tower.parameters() if p.grad is not None]).norm())

    query, passage = flat(model.query_encoder), flat(model.passage_encoder)
    assert values["grad_norm_query"] == pytest.approx(query, rel=1e-12)
    assert values["grad_norm_passage"] == pytest.approx(passage, rel=1e-12)
    assert values["grad_ratio_passage_query"] == pytest.approx(passage / query, rel=1e-12)
    assert abs(query - passage) > 1e-6 * query  # the two towers' gradients differ: a swap would show
    assert tower_grad_norms(tiny_model(toy_dir, shared=True)) == {}


def test_probe_gradients_measures_both_losses_at_the_steps_weights(world):
    """ContAccum's `probe_gradients` on a second step (banks filled by the first; dropout on and uniform negatives
    drawn from the strategy's generator, so both random states must be restored): its `banks` tower norms are the
    step's own gradient's, its `no_bank_rows` ones a passage-only bank's (same banks), its `no_banks` ones
    GradAccum's over the same micro-batches at the same weights; its ||dL/dQ|| without banks and its fresh-minus-
    banked score are hand computations; the step's gradients are bitwise the unprobed option's."""
    toy_dir, corpus, examples = world
    first, second = micro_batches(corpus, examples[:4], 2), micro_batches(corpus, examples[4:], 2)

    def two_steps(name: str, uniform: int = 2, dropout: float = 0.1, **keys):
        model = tiny_model(toy_dir)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = dropout
        torch.manual_seed(0)
        option = OPTIONS[name](BatchingConfig(name=name, micro_batches=2, **keys), step_parts(model, corpus, uniform))
        option.step(first)
        model.zero_grad(set_to_none=True)
        out = option.step(second)
        return out.logged, tower_grad_norms(model), gradients(model)

    logged, norms, probed_grads = two_steps("cont_accum", bank_size=4, probe_gradients=True)
    _, _, plain_grads = two_steps("cont_accum", bank_size=4)
    _, accum_norms, _ = two_steps("grad_accum")
    _, passage_only_norms, _ = two_steps("cont_accum", bank_size=4, bank_queries=False)
    for key in ("grad_norm_query", "grad_norm_passage", "grad_ratio_passage_query"):
        assert logged[f"probe/banks/{key}"] == pytest.approx(norms[key], rel=1e-12)
        assert logged[f"probe/no_bank_rows/{key}"] == pytest.approx(passage_only_norms[key], rel=1e-12)
        assert logged[f"probe/no_banks/{key}"] == pytest.approx(accum_norms[key], rel=1e-12)
    assert abs(norms["grad_norm_passage"] / accum_norms["grad_norm_passage"] - 1) > 1e-3  # the banks change it
    for key in probed_grads:
        assert torch.equal(probed_grads[key], plain_grads[key]), key

    model, hand, margins = tiny_model(toy_dir), [], []
    positives = torch.cat([batch.positives for batch in first + second])
    for k, batch in enumerate(second):  # the in-batch subset without uniform negatives: the positives in row order
        queries = model.encode_queries(batch.questions)
        queries.retain_grad()
        order = torch.argsort(batch.positives)
        passages = model.encode_passages(corpus.passages(batch.positives[order].tolist()))
        labels = torch.argsort(order)
        loss = torch.nn.functional.cross_entropy(queries @ passages.T / TEMPERATURE, labels)
        loss.backward()
        hand.append(float(queries.grad.norm()))
        with torch.no_grad():  # the 4 banked positives micro-batch k finds: the 4 enqueued before it
            banked = model.encode_passages(corpus.passages(positives[2 * k : 2 * k + 4].tolist()))
            fresh = queries @ passages.T
            others = fresh.sum() - fresh[torch.arange(len(labels)), labels].sum()
            margins.append(float(others / (fresh.numel() - len(labels)) - (queries @ banked.T).mean()))
    logged, _, _ = two_steps("cont_accum", uniform=0, dropout=0.0, bank_size=4, probe_gradients=True)
    assert logged["probe/no_banks/dloss_dquery"] == pytest.approx(sum(hand) / len(hand), rel=1e-9)
    for variant in ("banks", "no_bank_rows"):
        assert logged[f"probe/{variant}/fresh_minus_banked_score"] == pytest.approx(sum(margins) / 2, rel=1e-9)
    assert "probe/no_banks/fresh_minus_banked_score" not in logged


def test_bank_capacity_and_wrap():
    """Hand-checked FIFO: capacity 3, enqueue 2 then 2 then 5 (more than it holds: the newest 3 stay)."""
    banks = Banks(3, 1, torch.device("cpu"), hard_negatives=False)
    for values in ([1, 2], [3, 4], [5, 6, 7, 8, 9]):
        v = torch.tensor(values, dtype=torch.float32).unsqueeze(1)
        banks.enqueue(v, -v, torch.tensor(values))
        if values == [3, 4]:
            assert banks.ordered()["p_rows"].tolist() == [2, 3, 4] and banks.q[:, 0].tolist() == [4, 2, 3]
    assert banks.ordered()["p_rows"].tolist() == [7, 8, 9] and banks.ordered()["p"][:, 0].tolist() == [-7, -8, -9]


# -- config ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, strategy, keys, message", [
    ("cont_accum", "negative_cache", {"micro_batches": 2}, "loss of its own"),
    ("grad_accum", "in_batch", {"micro_batches": 2, "bank_size": 8}, "batching.bank_size=8 is not read"),
    ("plain", "in_batch", {"micro_batches": 2}, "micro_batches=2 is not read by batching.name='plain'"),
    ("grad_cache", "in_batch", {"micro_batches": 3}, "divisible by batching.micro_batches=3"),
    ("cont_accum", "in_batch", {"micro_batches": 2, "bank_size": 5}, "bank_size=5 must be divisible"),
    ("gradcache", "in_batch", {}, "is not one of"),
    ("grad_cache", "in_batch", {"micro_batches": 1}, "grad_cache needs batching.micro_batches >= 2"),
    ("grad_accum", "in_batch", {"micro_batches": 1}, "grad_accum needs batching.micro_batches >= 2"),
])
def test_config_refuses_what_an_option_cannot_run(name, strategy, keys, message):
    world = 2 if "bank_size" in keys and keys["bank_size"] == 5 else 1
    with pytest.raises(ConfigError, match=message):
        check_batching(BatchingConfig(name=name, **keys), REGISTRY[strategy], 16, world)
    for good in ("grad_accum", "grad_cache"):  # these take every strategy
        check_batching(BatchingConfig(name=good, micro_batches=2), REGISTRY["negative_cache"], 16, 1)



def test_registering_an_option_twice_or_without_a_config_fails():
    class Again(BatchingOption):
        """Plain again."""

        name = "plain"

    class NoConfig(BatchingOption):
        """No config."""

        name = "no_config_option"
        config = dict

    with pytest.raises(TypeError, match="batching option name 'plain' is registered twice"):
        register(Again)
    with pytest.raises(TypeError, match="must be a dataclass subclassing BaseBatchingConfig"):
        register(NoConfig)
    assert "no_config_option" not in OPTIONS and OPTIONS["plain"].__name__ == "Plain"


# -- in the recipe -------------------------------------------------------------------------------------------

OPTION_KEYS = {
    "grad_accum": {"batching.name": "grad_accum", "batching.micro_batches": 2},
    "grad_cache": {"batching.name": "grad_cache", "batching.micro_batches": 2},
    "cont_accum": {"batching.name": "cont_accum", "batching.micro_batches": 2, "batching.bank_size": 6},
}
RECIPE = {"train.batch_size": 8, "strategy.uniform_negatives": 2}


@pytest.mark.slow
def test_cont_accum_resume_reaches_the_uninterrupted_run(recipe_toy_dir, tmp_path):
    """The banks are checkpointed: 4 steps in one go (saving at 2) vs 2, then train.resume=true to 4."""
    keys = {**RECIPE, **OPTION_KEYS["cont_accum"], "train.steps": 4}
    whole = train_retriever(config(recipe_toy_dir, tmp_path / "whole", "in_batch", **{"train.save_every": 2, **keys}))
    train_retriever(config(recipe_toy_dir, tmp_path / "split", "in_batch", **{**keys, "train.steps": 2}))
    resumed = train_retriever(config(recipe_toy_dir, tmp_path / "split", "in_batch",
                                     **{**keys, "train.resume": "true"}))
    assert resumed["recall"] == whole["recall"] and whole["peak_memory_mib"] > 0
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "split")
    for key in a:
        assert torch.equal(a[key], b[key]), key


TWO_PROCESS_KEYS = {**RECIPE, "train.steps": 3}


def two_process_runs(toy_dir: Path, out: Path) -> dict[str, list[str]]:
    """The runs `test_two_processes_match_one_for_every_option` compares, `two-NAME` under `out` (the launch:
    conftest's `two_process_retriever_runs`)."""
    runs = {f"two-{name}": overrides(toy_dir, out / f"two-{name}", "in_batch", **TWO_PROCESS_KEYS, **extra)
            for name, extra in OPTION_KEYS.items()}
    runs["two-probed"] = overrides(toy_dir, out / "two-probed", "in_batch", **TWO_PROCESS_KEYS,
                                   **OPTION_KEYS["cont_accum"], **{"batching.probe_gradients": "true"})
    return runs


@pytest.mark.slow
@pytest.mark.xdist_group("retriever_runs")
def test_two_processes_match_one_for_every_option(recipe_toy_dir, tmp_path, two_process_retriever_runs):
    """One `accelerate launch` of 2 processes runs the three options in turn, with the strategies of
    tests/test_train_retriever.py (tests/dist/retriever_runs.py); each against the same config on one process.
    GradCache and ContAccum gather the global batch's passages and bank the global micro-batches, so the runs agree
    to float tolerance. ContAccum also runs once more on two processes with `probe_gradients`: bitwise the weights
    of the unprobed two-process run, and its probe with the banks gives each step's own (reduced) gradient-norm
    ratio."""
    keys, folder = TWO_PROCESS_KEYS, two_process_retriever_runs
    for name, extra in OPTION_KEYS.items():
        one = train_retriever(config(recipe_toy_dir, tmp_path / f"one-{name}", "in_batch", **keys, **extra))
        two = json.loads((folder / f"two-{name}" / "metrics.json").read_text())
        assert two["steps"] == one["steps"] == 3 and two["batching"] == name
        a, b = weights(tmp_path / f"one-{name}"), weights(folder / f"two-{name}")
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    a, probed = weights(folder / "two-cont_accum"), weights(folder / "two-probed")
    for key in a:
        assert torch.equal(probed[key], a[key]), key
    probed_metrics = json.loads((folder / "two-probed" / "metrics.json").read_text())
    assert probed_metrics["by_step"]["probe/banks/grad_ratio_passage_query"] == pytest.approx(
        probed_metrics["grad_ratio_by_step"], rel=1e-6)


# -- a new option is one file -----------------------------------------------------------------------------------

NEW_OPTION = '''
"""Test option: plain's step with its loss multiplied by `batching.loss_scale` (its own key)."""

from dataclasses import dataclass

from rag_train.config import ConfigError
from rag_train.train.batching.base import BaseBatchingConfig, register
from rag_train.train.batching.plain import Plain


@dataclass
class ScaledConfig(BaseBatchingConfig):
    loss_scale: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not self.loss_scale > 0:
            raise ConfigError(f"batching.loss_scale={self.loss_scale} must be > 0")


@register
class Scaled(Plain):
    """The whole batch in one forward, its loss scaled by loss_scale."""

    name = "scaled"
    config = ScaledConfig

    def step(self, micro_batches):
        result = super().step(micro_batches)
        result.loss = result.loss * self.cfg.loss_scale
        return result
'''

# In a fresh interpreter, the new module's folder is added to the package's search path before the package (and
# its discovery) is imported: what a new file in rag_train/train/batching/ does.
OPTION_DRIVER = drop_in("rag_train.train.batching") + '''
import json, sys

import torch
from rag_train.config import ConfigError, load_config
from rag_train.models.retriever import DualEncoder
from rag_train.train.batching import OWNERS, BatchingConfig
from rag_train.train.retriever import train_retriever
from rag_train.train.schema import RetrieverTrainConfig

config, args = sys.argv[2], sys.argv[3:]
from rag_train.train.batching import REGISTRY

out = {"documented": "scaled: The whole batch in one forward, its loss scaled by loss_scale." in BatchingConfig.__doc__,
       "registered": list(REGISTRY), "loss_scale_read_by": OWNERS["loss_scale"]}
for name, extra in [("bad_value", ["batching.name=scaled", "batching.loss_scale=-1"]),
                    ("plain_given_its_key", ["batching.name=plain", "batching.loss_scale=2"])]:
    try:
        load_config(RetrieverTrainConfig, config, [*args, *extra])
        out[name] = "accepted"
    except ConfigError as exc:
        out[name] = str(exc)
weights = {}
for name in ("scaled", "plain"):
    cfg = load_config(RetrieverTrainConfig, config,
                      [*args, f"batching.name={name}", f"train.output_dir={sys.argv[1]}/{name}"]
                      + (["batching.loss_scale=1.0"] if name == "scaled" else []))
    out[name] = train_retriever(cfg)["steps"]
    weights[name] = DualEncoder.load(f"{sys.argv[1]}/{name}/retriever").state_dict()
out["same_weights"] = all(torch.equal(weights["scaled"][k], weights["plain"][k]) for k in weights["plain"])
out["saved"] = open(sys.argv[1] + "/scaled/config.yaml").read()
print("RESULT " + json.dumps(out))
'''


@pytest.mark.slow
def test_a_new_option_is_one_file(recipe_toy_dir, tmp_path):
    """A batching option dropped in as one file: its own key is validated by its class, refused for another
    option, documented by its docstring, and a run with it trains (at loss_scale 1, exactly as plain does)."""
    (tmp_path / "scaled.py").write_text(NEW_OPTION)
    args = [a for a in overrides(recipe_toy_dir, tmp_path / "unused", "stale", steps=2)
            if not a.startswith("train.output_dir=")]
    proc = subprocess.run([sys.executable, "-c", OPTION_DRIVER, str(tmp_path), str(CONFIG), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["documented"]
    assert out["registered"] == ["cont_accum", "grad_accum", "grad_cache", "plain", "scaled"]  # by name
    assert out["loss_scale_read_by"] == ["scaled"]
    assert out["bad_value"] == "batching.loss_scale=-1.0 must be > 0"
    assert out["plain_given_its_key"] == ("override 'batching.loss_scale=2': batching 'plain' does not read "
                                          "batching.loss_scale (a key of scaled)")
    assert out["scaled"] == out["plain"] == 2 and out["same_weights"]
    assert "loss_scale: 1.0" in out["saved"]

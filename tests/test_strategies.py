"""Strategies against brute force: stale / exhaustive / SNM / negative cache / corrector, on a tiny model,
a hand-made 40-passage corpus and a float32 buffer built by `build_buffer`."""

from __future__ import annotations

import copy
import functools
import json

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from scipy.stats import chisquare

from rag_train.buffer import nystrom
from rag_train.buffer.build import build_buffer
from rag_train.buffer.store import Buffer, decode_rows
from rag_train.config import BufferConfig, ConfigError, RetrieverConfig, TinyModelConfig
from rag_train.data.corpus import Corpus
from rag_train.data.tokenizer import train_tokenizer
from rag_train.models.retriever import DualEncoder, format_passage
from rag_train.strategies import REGISTRY, StrategyConfig, StrategyContext, build_strategy
from rag_train.strategies.base import read_rows
from rag_train.strategies.corrector import CorrectorConfig, CorrectorStrategy
from rag_train.strategies.exhaustive import Exhaustive
from rag_train.strategies.negative_cache import NegativeCache
from rag_train.strategies.snm import SNM
from rag_train.strategies.stale import Stale

TINY = TinyModelConfig(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=1, num_decoder_layers=1)
ROWS = 40
WORDS = "river stone tower city founded painted green blue north old mentor violin born year harbour".split()
QUESTIONS = ["who founded the city", "what colour is the tower", "where was the mentor born", "which violin"]
ALGORITHM_1 = [name for name, cls in REGISTRY.items() if 1 in cls.algorithms]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategies")
    rng = np.random.default_rng(1)
    with open(root / "passages.jsonl", "w", encoding="utf-8") as handle:
        for i in range(ROWS):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 20))))
            handle.write(json.dumps({"id": f"p{i}", "title": f"Place {i}", "text": text}) + "\n")
    corpus = Corpus.open(root / "passages.jsonl")
    tokenizer = train_tokenizer([format_passage(p) for p in corpus.passages(range(ROWS))] + QUESTIONS,
                                root / "tok", vocab_size=300)
    model = DualEncoder.from_config(RetrieverConfig(model="tiny", tiny=TINY), tokenizer)
    build_buffer(model, corpus, root / "buffer", batch_size=16, shard_rows=16, dtype="float32")
    return {"corpus": corpus, "model": model, "buffer_dir": root / "buffer", "accelerator": Accelerator(cpu=True)}


def make(world, name: str, temperature: float = 0.5, search: str = "full", fused: bool = False, **changes):
    """A strategy over a private copy of the model (tests change the encoder freely)."""
    model = copy.deepcopy(world["model"])
    cfg = StrategyConfig(name=name, **{"top_k": 5, "uniform_negatives": 0, **changes})
    buffer = BufferConfig(chunk_rows=7, embed_batch_size=8, search=search, rerank_candidates=12, fused_search=fused)
    ctx = StrategyContext(world["accelerator"], model, world["corpus"], buffer, world["buffer_dir"], temperature,
                          seed=3)
    return build_strategy(cfg, ctx), model


def stale_matrix(world) -> torch.Tensor:
    return torch.from_numpy(np.array(Buffer.open(world["buffer_dir"]).array(), dtype=np.float32))


def queries_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval().encode_queries(QUESTIONS).float()


def fresh_embedding(model, corpus, rows) -> torch.Tensor:
    with torch.no_grad():
        return model.eval().encode_passages(corpus.passages(list(rows))).float()


def brute_topk(queries: torch.Tensor, vectors: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k by score, ties to the lower row (numpy lexsort: score descending, then row ascending)."""
    scores = (queries.double() @ vectors.double().T).numpy()
    rows = np.arange(scores.shape[1])
    return torch.as_tensor(np.stack([np.lexsort((rows, -s))[:k] for s in scores]))


def perturb(module: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(scale * torch.randn(param.shape, generator=gen))


def test_registry_names_build(world):
    for name in REGISTRY:
        strategy, _ = make(world, name)
        assert isinstance(strategy, REGISTRY[name])


def test_stale_is_brute_force_and_never_changes(world):
    strategy, model = make(world, "stale")
    assert isinstance(strategy, Stale)
    stale = stale_matrix(world)
    queries = queries_of(model)
    torch.testing.assert_close(strategy.vectors, stale, rtol=0, atol=0)
    expected = brute_topk(queries, stale, 5)
    assert torch.equal(strategy.retrieve(queries, 5), expected)

    positives = torch.tensor([0, 7, 7, 39])
    subset = strategy.subset(queries, positives)
    assert torch.equal(subset.rows, torch.unique(torch.cat([positives, expected.reshape(-1)])))
    assert torch.equal(subset.rows[subset.positive_index], positives)

    shard_bytes = [p.read_bytes() for p in sorted(world["buffer_dir"].glob("*.npy"))]
    for step in range(1, 4):  # the encoder trains; the buffer and the search must not move
        perturb(model, seed=step)
        strategy.after_step(step)
        torch.testing.assert_close(strategy.vectors, stale, rtol=0, atol=0)
        assert torch.equal(strategy.retrieve(queries, 5), expected)
    assert not torch.allclose(fresh_embedding(model, world["corpus"], range(ROWS)), stale, atol=1e-3)
    assert [p.read_bytes() for p in sorted(world["buffer_dir"].glob("*.npy"))] == shard_bytes
    assert strategy.embedded == 0


@pytest.mark.parametrize("name", ["stale", "corrector"])
def test_rerank_search_is_brute_force_over_the_buffer(world, name):
    """buffer.search=rerank: FAISS (Flat: exact) candidates re-scored with <q, b> (stale) or <q, h(b)> (corrector)."""
    strategy, model = make(world, name, search="rerank", corrector=CorrectorConfig(hidden=12))
    assert strategy.faiss_index is not None and strategy.search_mode == "corrector_rerank"
    stale, queries = stale_matrix(world), queries_of(model)
    if name == "corrector":
        perturb(strategy.corrector, scale=0.5, seed=42)
    with torch.no_grad():
        target = strategy.corrector(stale) if name == "corrector" else stale
    # Flat candidates are the true top-12 of <q, b>; with h the answer is brute force over those candidates
    candidates = brute_topk(queries, stale, 12)
    expected = torch.stack([c[brute_topk(q[None], target[c], 5)[0]] for q, c in zip(queries, candidates)])
    assert torch.equal(strategy.retrieve(queries, 5), expected)


def test_exhaustive_refreshes_every_r_steps_with_the_current_model(world):
    strategy, model = make(world, "exhaustive", refresh_every=2)
    assert isinstance(strategy, Exhaustive)
    stale, corpus = stale_matrix(world), world["corpus"]
    perturb(model, seed=11)
    strategy.after_step(1)  # not a refresh step: still the stale buffer, although the model moved
    torch.testing.assert_close(strategy.vectors, stale, rtol=0, atol=0)
    fresh = fresh_embedding(model, corpus, range(ROWS))
    assert not torch.allclose(fresh, stale, atol=1e-3)
    assert strategy.embedded == 0

    strategy.after_step(2)
    torch.testing.assert_close(strategy.vectors, fresh, rtol=1e-5, atol=1e-5)
    assert strategy.embedded == ROWS
    refreshed = strategy.vectors.clone()
    queries = queries_of(model)
    assert torch.equal(strategy.retrieve(queries, 5), brute_topk(queries, strategy.vectors, 5))

    perturb(model, seed=12)
    strategy.after_step(3)
    torch.testing.assert_close(strategy.vectors, refreshed, rtol=0, atol=0)
    strategy.after_step(4)
    torch.testing.assert_close(strategy.vectors, fresh_embedding(model, corpus, range(ROWS)), rtol=1e-5, atol=1e-5)
    assert strategy.embedded == 2 * ROWS


def test_snm_samples_uniformly_and_refreshes_every_r_steps(world):
    m = 10
    strategy, model = make(world, "snm", refresh_every=2, snm_targets=m)
    assert isinstance(strategy, SNM)
    stale, corpus = stale_matrix(world), world["corpus"]
    first = strategy.index_rows.clone()
    assert len(first) == m and len(torch.unique(first)) == m and torch.equal(first, first.sort().values)
    assert 0 <= first.min() and first.max() < ROWS
    torch.testing.assert_close(strategy.vectors, stale[first], rtol=0, atol=0)  # first sample: the buffer
    queries = queries_of(model)
    assert torch.equal(strategy.retrieve(queries, 4), first[brute_topk(queries, stale[first], 4)])

    perturb(model, seed=21)
    strategy.after_step(1)
    assert torch.equal(strategy.index_rows, first) and strategy.embedded == 0
    strategy.after_step(2)
    second = strategy.index_rows
    assert not torch.equal(second, first) and len(torch.unique(second)) == m
    torch.testing.assert_close(strategy.vectors, fresh_embedding(model, corpus, second.tolist()), rtol=1e-5, atol=1e-5)
    assert strategy.embedded == m
    strategy.after_step(4)
    assert strategy.embedded == 2 * m

    draws = 400  # every row is in a uniform M-of-N sample with probability M / N
    counts = np.zeros(ROWS)
    for _ in range(draws):
        strategy.resample(reembed=False)
        counts[strategy.index_rows.numpy()] += 1
    assert counts.sum() == draws * m
    assert chisquare(counts).pvalue > 1e-4


def test_negative_cache_is_fifo_and_replaces_with_the_current_model(world):
    size, refresh = 8, 2
    strategy, model = make(world, "negative_cache", cache_size=size, cache_refresh=refresh)
    assert isinstance(strategy, NegativeCache)
    stale, corpus = stale_matrix(world), world["corpus"]
    torch.testing.assert_close(strategy.cache_vectors, stale[strategy.cache_rows], rtol=0, atol=0)
    replaced_at = np.full(size, -1)
    for step in range(1, 9):
        perturb(model, seed=30 + step)  # a new model version every step: each entry's vectors date it
        before = strategy.cache_vectors.clone()
        strategy.after_step(step)
        changed = (strategy.cache_vectors != before).any(dim=1).nonzero().reshape(-1)
        expected_slots = ((step - 1) * refresh + np.arange(refresh)) % size
        assert sorted(changed.tolist()) == sorted(expected_slots.tolist())
        rows = strategy.cache_rows[changed]
        torch.testing.assert_close(strategy.cache_vectors[changed], fresh_embedding(model, corpus, rows.tolist()),
                                   rtol=1e-5, atol=1e-5)
        if step > size // refresh:  # an entry lives exactly cache_size / cache_refresh steps
            assert all(step - replaced_at[s] == size // refresh for s in expected_slots)
        replaced_at[expected_slots] = step
        assert strategy.embedded == step * refresh
    assert (replaced_at > 0).all()


def test_negative_cache_never_samples_the_positive(world):
    strategy, model = make(world, "negative_cache", cache_size=6, cache_refresh=2, temperature=0.05)
    strategy.cache_rows[:] = torch.tensor([3, 3, 5, 9, 9, 9])  # positives are in the cache, several times
    strategy.cache_vectors = fresh_embedding(model, world["corpus"], strategy.cache_rows.tolist())
    queries = queries_of(model)
    positives = torch.tensor([3, 9, 5, 9])
    seen = set()
    for _ in range(50):
        subset = strategy.subset(queries, positives)
        negatives = subset.rows[subset.negative_index]
        assert (negatives != positives).all()
        assert set(negatives.tolist()) <= set(strategy.cache_rows.tolist())
        assert torch.equal(subset.rows[subset.positive_index], positives)
        assert torch.equal(subset.rows, torch.unique(torch.cat([positives, negatives])))
        seen.update(zip(positives.tolist(), negatives.tolist()))
    assert {(3, 5), (3, 9)} <= seen  # sampled, not a fixed choice


@pytest.mark.parametrize("fused", [False, True])
def test_corrector_search_goes_through_h(world, fused, monkeypatch):
    """Also with buffer.fused_search: the strategy's search scores its chunks with the fused scorer (its function
    left uncompiled here: tests/test_search.py checks the compiled one)."""
    import rag_train.buffer.chunk_scores as chunk_scores

    calls = []

    def uncompiled(device_type):
        calls.append(device_type)
        return chunk_scores.corrector_chunk_scores

    monkeypatch.setattr(chunk_scores, "compiled_chunk_scores", uncompiled)
    strategy, model = make(world, "corrector", fused=fused, corrector=CorrectorConfig(hidden=12))
    assert isinstance(strategy, CorrectorStrategy)
    stale = stale_matrix(world)
    queries = queries_of(model)
    stale_strategy, _ = make(world, "stale")
    assert torch.equal(strategy.retrieve(queries, 6), stale_strategy.retrieve(queries, 6))  # h = identity at init
    assert torch.equal(strategy.retrieve(queries, 6), brute_topk(queries, stale, 6))

    perturb(strategy.corrector, scale=0.5, seed=41)
    with torch.no_grad():
        corrected = strategy.corrector(stale)
    expected = brute_topk(queries, corrected, 6)
    assert not torch.equal(expected, brute_topk(queries, stale, 6))
    assert torch.equal(strategy.retrieve(queries, 6), expected)
    assert bool(calls) is fused


def test_standardized_corrector_reads_the_buffers_moments_and_searches_through_h(world):
    """strategy.corrector.standardize: the input statistics are the stale buffer's (numpy over its rows), and search
    (the folded first layer) is brute force over h(B)."""
    strategy, model = make(world, "corrector", corrector=CorrectorConfig(hidden=12, standardize=True))
    stale = stale_matrix(world).double()
    torch.testing.assert_close(strategy.corrector.input_mean.double(), stale.mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(strategy.corrector.input_std.double(), stale.std(0, unbiased=False),
                               rtol=1e-5, atol=1e-6)
    perturb(strategy.corrector, scale=0.5, seed=41)
    queries = queries_of(model)
    with torch.no_grad():
        corrected = strategy.corrector(stale.float())
    assert torch.equal(strategy.retrieve(queries, 6), brute_topk(queries, corrected, 6))


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_corrector_and_task_gradients_are_separate(world, loss):
    strategy, model = make(world, "corrector", corrector=CorrectorConfig(hidden=12, loss=loss), uniform_negatives=2)
    assert strategy.modules() == {"corrector": strategy.corrector}  # a part of the recipe's one prepared module
    assert [g["auxiliary"] for g in strategy.param_groups()] == [True]
    perturb(strategy.corrector, scale=0.2, seed=51)  # W2 != 0, so every corrector parameter gets a gradient
    corpus = world["corpus"]
    subset = strategy.subset(queries_of(model), torch.tensor([1, 2, 3, 4]))
    model.train()
    queries, passages = model(QUESTIONS, corpus.passages(subset.rows.tolist()))
    scores = queries @ passages.T
    encoder = [p for p in model.parameters() if p.requires_grad]
    corrector = list(strategy.corrector.parameters())

    task, _ = strategy.task_loss(scores, subset)
    task.backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for p in corrector)
    assert sum(float(p.grad.abs().sum()) for p in encoder if p.grad is not None) > 0
    model.zero_grad(set_to_none=True)

    # the recipe's call pattern: queries detached; fresh vectors / scores still carrying their graph
    aux = strategy.auxiliary_loss(queries.detach(), subset.rows, passages, scores)
    aux.backward()
    assert all(p.grad is None or not p.grad.any() for p in encoder)
    assert all(p.grad is not None and p.grad.any() for p in corrector)


@pytest.mark.parametrize("name", ALGORITHM_1)
def test_algorithm_1_subset_contains_the_positives(world, name):
    strategy, model = make(world, name, uniform_negatives=3, cache_size=8, cache_refresh=2, snm_targets=12)
    queries = queries_of(model)
    for trial, positives in enumerate([torch.tensor([0, 1, 2, 3]), torch.tensor([39, 39, 5, 20])]):
        subset = strategy.subset(queries, positives)
        assert torch.equal(subset.rows, torch.unique(subset.rows))  # sorted, unique: same order on every process
        assert torch.equal(subset.rows[subset.positive_index], positives)
        assert set(positives.tolist()) <= set(subset.rows.tolist()) and subset.rows.max() < ROWS
        expected_min = len(set(positives.tolist()))
        assert len(subset.rows) > expected_min  # negatives beyond the positives, for every strategy
        strategy.after_step(trial + 1)


def test_algorithm_1_loss_matches_hand_computation(world):
    """truncated softmax CE over the shared subset with temperature, and its gradients, vs numpy by hand."""
    temperature = 0.3
    strategy, model = make(world, "stale", temperature=temperature, uniform_negatives=2)
    positives = torch.tensor([4, 8, 15, 16])
    subset = strategy.subset(queries_of(model), positives)
    with torch.no_grad():
        q0, p0 = model(QUESTIONS, world["corpus"].passages(subset.rows.tolist()))
    q = q0.double().clone().requires_grad_(True)
    p = p0.double().clone().requires_grad_(True)
    loss, _ = strategy.task_loss(q @ p.T, subset)
    loss.backward()

    qn, pn, target = q0.double().numpy(), p0.double().numpy(), subset.positive_index.numpy()
    batch = len(qn)
    logits = qn @ pn.T / temperature
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    hand = np.mean(-np.log(probs[np.arange(batch), target]))
    onehot = np.zeros_like(probs)
    onehot[np.arange(batch), target] = 1.0
    d_logits = (probs - onehot) / batch / temperature
    np.testing.assert_allclose(loss.item(), hand, rtol=1e-10)
    np.testing.assert_allclose(q.grad.numpy(), d_logits @ pn, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(p.grad.numpy(), d_logits.T @ qn, rtol=1e-8, atol=1e-12)


DYNNIBAL = dict(warm_start_steps=0, full_refresh_step=0, landmarks=32, nystrom_samples=8, trees=2, tree_children=4,
                tree_leaf=2, max_clusters=20, mh_chains=5)  # 32 landmarks span the 32-d vectors: the cache is exact


def test_dynnibal_negatives_score_higher_than_uniform_ones(world):
    """Under the current model (here the buffer's), by brute-force scoring of every passage: the negatives Dynnibal
    samples at a low sampling temperature outscore uniform ones (drawn, and in expectation), stay below the exact
    top-k, and fall to the uniform level when the sampling temperature (not the loss's) is raised."""
    rng = np.random.default_rng(0)
    questions = [" ".join(rng.choice(WORDS, 4)) for _ in range(32)]
    positives = torch.arange(32) % ROWS
    means = {}
    for temperature in (0.05, 100.0):
        strategy, model = make(world, "dynnibal", sampling_temperature=temperature, **DYNNIBAL)
        with torch.no_grad():
            queries = model.eval().encode_queries(questions).float()
        scores = (queries.double() @ fresh_embedding(model, world["corpus"], range(ROWS)).double().T).numpy()
        strategy.positives = positives
        sampled = strategy.retrieve_global(queries, 5).numpy()
        negative = sampled != positives.numpy()[:, None]  # padding: the chains found fewer than 5 other targets
        assert negative.mean() > 0.5
        means[temperature] = np.take_along_axis(scores, sampled, 1)[negative].mean()
        logged = strategy.logged_values()
        assert logged["dynnibal/sampled"] == 1.0 and logged["dynnibal/clusters_per_query"] > 2  # beyond the roots
    uniform = np.take_along_axis(scores, strategy.uniform_rows(32 * 5).reshape(32, 5).numpy(), 1).mean()
    off_positive = np.ones_like(scores, dtype=bool)
    off_positive[np.arange(32), positives.numpy()] = False
    expected_uniform = scores[off_positive].mean()
    best = np.sort(np.where(off_positive, scores, -np.inf), axis=1)[:, -5:].mean()
    assert means[0.05] > max(uniform, expected_uniform) + 0.05
    assert means[0.05] <= best + 1e-12
    assert abs(means[100.0] - expected_uniform) < means[0.05] - expected_uniform - 0.05  # beta ~ 0: near uniform


def test_dynnibal_refuses_a_forest_whose_roots_split_past_the_cap(world):
    """max_clusters = tree_children passes the config check, but covering can make every root split further: on
    orthonormal targets (all pairwise sqrt(2) apart) a root's net must take every point. The strategy refuses
    such a forest when it builds it, since FindClustering could only return the roots."""
    strategy, _ = make(world, "dynnibal", **{**DYNNIBAL, "max_clusters": 4})
    assert strategy.low is not None  # the buffer's forest fits the cap
    with pytest.raises(ConfigError, match=r"strategy.max_clusters=4: every SG tree's root splits into more clusters "
                                          r"\(20 or more\)"):
        strategy.start(strategy.projection, np.eye(ROWS, dtype=np.float32))


def step_cache(strategy, queries, positives, step):
    """One Algorithm 1 step of the trainable cache as the recipe drives it: subset, forward (auxiliary), update."""
    subset = strategy.subset(queries, positives)
    assert strategy.auxiliary_loss(queries, subset.rows, None, None) is None  # nothing for the optimizer
    strategy.after_step(step)
    return subset


def test_trainable_cache_moves_the_touched_rows_by_the_gradient(world, tmp_path):
    """Rows of the step's subset move by exactly -lr x dL_C/dC (the truncated softmax over the subset with the cached
    rows, by hand in float64), every other row stays bitwise; retrieval then goes through the moved rows (brute
    force); the state survives a checkpoint bitwise, and the next step is the same from it."""
    lr, temperature = 0.3, 0.5
    strategy, model = make(world, "trainable_cache", temperature=temperature, uniform_negatives=2, row_lr=lr)
    queries, positives = queries_of(model), torch.tensor([4, 8, 15, 16])
    before = strategy.vectors.clone()
    assert torch.equal(before, stale_matrix(world))  # the buffer at the start
    subset = step_cache(strategy, queries, positives, 1)
    rows = subset.rows.numpy()

    q, cached = queries.double().numpy(), before.double().numpy()[rows]
    logits = q @ cached.T / temperature
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    onehot = np.zeros_like(probs)
    onehot[np.arange(len(q)), subset.positive_index.numpy()] = 1.0
    grad = (probs - onehot).T @ q / len(q) / temperature
    moved = strategy.vectors[subset.rows]
    np.testing.assert_allclose(moved.double().numpy(), cached - lr * grad, rtol=0, atol=1e-6)
    assert (moved != before[subset.rows]).any(dim=1).all()  # every touched row moved
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[subset.rows] = False
    assert untouched.sum() > 0 and torch.equal(strategy.vectors[untouched], before[untouched])
    assert strategy.logged_values()["trainable_cache/rows"] == len(rows) == strategy.summary()["updated_rows"]
    assert torch.equal(strategy.retrieve_global(queries, 5), brute_topk(queries, strategy.vectors, 5))

    strategy.save(tmp_path)
    resumed, _ = make(world, "trainable_cache", temperature=temperature, uniform_negatives=2, row_lr=lr)
    resumed.load(tmp_path)
    assert torch.equal(resumed.vectors, strategy.vectors) and resumed.updated_rows == strategy.updated_rows
    for s in (strategy, resumed):
        step_cache(s, queries, positives, 2)
    assert torch.equal(resumed.vectors, strategy.vectors) and not torch.equal(strategy.vectors[subset.rows], moved)


@pytest.fixture(scope="module")
def bfloat16_buffer(world, tmp_path_factory):
    """The world's buffer again in bfloat16 (stored as its bits), 3 shards."""
    directory = tmp_path_factory.mktemp("bf16") / "buffer"
    build_buffer(world["model"], world["corpus"], directory, batch_size=16, shard_rows=16, dtype="bfloat16")
    return directory


def test_gathered_rows_are_the_buffer_rows_in_every_dtype(world, bfloat16_buffer, monkeypatch):
    """`read_rows` (what the corrector, SNM, the negative cache and Dynnibal read stale vectors with) against the
    whole buffer loaded by torch: rows across shards, in any order, repeated; bfloat16 decoded, not its bits; and
    without `Buffer.shard`, which copies every shard it spans (the whole buffer, each step, at 28M rows)."""
    rows = torch.tensor([[39, 0, 17], [16, 15, 39]])
    for directory in (world["buffer_dir"], bfloat16_buffer):
        buffer = Buffer.open(directory)
        assert len(buffer.manifest["shards"]) == 3
        whole = buffer.tensor().float()
        projection = nystrom.whitening(whole[:6].double().numpy())
        with monkeypatch.context() as patch:
            patch.setattr(Buffer, "shard", lambda *a: pytest.fail("read the buffer through Buffer.shard"))
            torch.testing.assert_close(read_rows(buffer, rows), whole[rows], rtol=0, atol=0)
        decode = functools.partial(decode_rows, dtype=buffer.dtype)  # Dynnibal's representations, shard by shard
        low = np.concatenate([nystrom.represent(piece, projection, decode=decode) for _, piece in buffer.views()])
        np.testing.assert_array_equal(low, nystrom.represent(whole.numpy(), projection))
    bf16, fp32 = (Buffer.open(d).tensor().float() for d in (bfloat16_buffer, world["buffer_dir"]))
    torch.testing.assert_close(bf16, fp32, rtol=1e-2, atol=1e-2)  # the same vectors at bfloat16 precision


def test_rerank_over_a_bfloat16_buffer_is_brute_force_over_its_values(world, bfloat16_buffer):
    strategy, model = make(world, "stale", search="rerank")
    bf16 = Buffer.open(bfloat16_buffer).tensor().float()
    strategy.ctx.buffer_dir = bfloat16_buffer
    strategy.buffer = Buffer.open(bfloat16_buffer)
    strategy.build_index()
    queries = queries_of(model)
    candidates = brute_topk(queries, bf16, 12)
    expected = torch.stack([c[brute_topk(q[None], bf16[c], 5)[0]] for q, c in zip(queries, candidates)])
    assert torch.equal(strategy.retrieve(queries, 5), expected)

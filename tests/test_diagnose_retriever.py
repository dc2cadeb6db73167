"""scripts/diagnose_retriever.py on a tiny corrector run, against a brute-force recomputation: the rows the
corrector trained on (recorded in the strategy's checkpointed state), h(B) by the formula b + W2 relu(W1 b + c1) + c2,
per-row cosines / errors against fresh g(y), and top-k overlaps by set intersection."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rag_lab.analysis.diagnose_retriever import (
    checkpoint_retriever,
    corpus_drift,
    diagnose,
    diagnose_checkpoints,
    fit_offline,
    fit_targets,
    held_out_map,
    latest_checkpoint,
    main,
)
from rag_train.buffer.store import Buffer
from rag_train.data.corpus import Corpus
from rag_train.data.supervised import load_retrieval
from rag_train.eval.retrieval import load_eval_set
from rag_train.models.retriever import DualEncoder
from rag_train.strategies.corrector import CorrectorStrategy
from rag_train.train.retriever import train_retriever

from test_train_retriever import PASSAGES, config

K, QUESTIONS = 3, 20


@pytest.fixture(scope="module")
def corrector_run(recipe_toy_dir, tmp_path_factory):
    """A 6-step corrector run that keeps a checkpoint every 2 steps, with every row set the corrector loss was
    computed on."""
    out = tmp_path_factory.mktemp("diagnose") / "run"
    subsets = []
    original = CorrectorStrategy.auxiliary_loss

    def recording(self, queries, rows, fresh_vectors, fresh_scores):
        subsets.append((rows.clone(), fresh_vectors.clone()))
        return original(self, queries, rows, fresh_vectors, fresh_scores)

    searched, stepped = [], []
    search, after_step = CorrectorStrategy.retrieve_global, CorrectorStrategy.after_step

    def searching(self, queries, k):  # the corrector's weights each search reads
        searched.append({k: v.detach().clone() for k, v in self.corrector.state_dict().items()})
        return search(self, queries, k)

    def stepping(self, step):  # and its weights after each optimizer step
        stepped.append({k: v.detach().clone() for k, v in self.corrector.state_dict().items()})
        return after_step(self, step)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CorrectorStrategy, "auxiliary_loss", recording)
        patch.setattr(CorrectorStrategy, "retrieve_global", searching)
        patch.setattr(CorrectorStrategy, "after_step", stepping)
        train_retriever(config(recipe_toy_dir, out, "corrector",
                               **{"strategy.corrector.lr": 1e-2, "train.save_every": 2, "train.keep_checkpoints": 0}))
    CORRECTOR_WEIGHTS[out] = (searched, stepped)
    return out, subsets


CORRECTOR_WEIGHTS: dict = {}


def test_each_search_uses_the_corrector_of_the_previous_step(corrector_run):
    """Retrieval at step t + 1 goes through h as the optimizer left it after step t (not a stale copy), and the
    corrector's own lr moves it every step."""
    searched, stepped = CORRECTOR_WEIGHTS[corrector_run[0]]
    assert len(searched) == len(stepped) == 6
    assert torch.equal(searched[0]["second.weight"], torch.zeros_like(searched[0]["second.weight"]))  # identity at init
    for before, after in zip(searched[1:], stepped[:-1]):
        assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not torch.equal(a["first.weight"], b["first.weight"]) for a, b in zip(stepped, stepped[1:]))


def test_seen_rows_are_the_corrector_subsets(corrector_run):
    run, subsets = corrector_run
    counts = load_file(str(latest_checkpoint(run) / "strategy-rank0.safetensors"))["seen"].numpy()
    expected = np.zeros(PASSAGES, dtype=np.int64)
    for rows, _ in subsets:
        expected[rows.unique().numpy()] += 1
    assert len(subsets) == 6 and counts.shape == (PASSAGES,)
    np.testing.assert_array_equal(counts, np.minimum(expected, 255))
    assert 0 < (counts > 0).sum() < PASSAGES  # both groups exist


def test_numbers_match_a_brute_force_computation(corrector_run, recipe_toy_dir, capsys):
    run, _ = corrector_run
    torch.set_num_threads(1)
    report = diagnose(run, K, QUESTIONS)

    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    retriever = DualEncoder.load(run / "retriever").eval()
    with torch.no_grad():
        fresh = np.concatenate([retriever.encode_passages(corpus.passages([row])).double().numpy()
                                for row in range(len(corpus))])
    buffer = Buffer.open(run / "buffer")
    stale = np.asarray(buffer.array(), dtype=np.float64)
    weights = {k: v.double().numpy() for k, v in load_file(str(latest_checkpoint(run) / "model.safetensors")).items()}
    hidden = np.maximum(stale @ weights["corrector.first.weight"].T + weights["corrector.first.bias"], 0)
    corrected = stale + hidden @ weights["corrector.second.weight"].T + weights["corrector.second.bias"]
    assert np.abs(corrected - stale).max() > 1e-4  # the corrector moved: the two columns can differ
    seen = load_file(str(latest_checkpoint(run) / "strategy-rank0.safetensors"))["seen"].numpy() > 0

    def cosines(a, b):
        return [float(x @ y / np.linalg.norm(x) / np.linalg.norm(y)) for x, y in zip(a, b)]

    for group, mask in {"seen": seen, "unseen": ~seen, "all": np.ones_like(seen)}.items():
        stats = report["rows"][group]
        assert stats["n"] == mask.sum()
        for name, vectors in {"stale": stale, "corrector": corrected}.items():
            assert stats[name]["cosine"] == pytest.approx(np.mean(cosines(vectors[mask], fresh[mask])), abs=2e-3)
            errors = [np.linalg.norm(v - g) / np.linalg.norm(g) for v, g in zip(vectors[mask], fresh[mask])]
            assert stats[name]["relative_error"] == pytest.approx(np.mean(errors), abs=2e-3)
    design = np.hstack([stale, np.ones((len(stale), 1))])
    fitted = design @ np.linalg.lstsq(design[seen], fresh[seen], rcond=None)[0]
    assert report["rows"]["unseen"]["lstsq"]["cosine"] == pytest.approx(
        np.mean(cosines(fitted[~seen], fresh[~seen])), abs=2e-3)

    dev = load_eval_set(recipe_toy_dir / "retrieval-dev.jsonl", corpus, limit=QUESTIONS)
    gold = corpus.rows([next(iter(q)) for q in dev.qrels])
    with torch.no_grad():
        queries = retriever.encode_queries(dev.questions).double().numpy()
    reference = [set(np.argsort(-(q @ fresh.T), kind="stable")[:K]) for q in queries]
    for name, vectors in {"fresh": fresh, "stale": stale, "corrector": corrected}.items():
        found = next(r for r in report["rankings"] if r["questions"].endswith("(dev)") and r["searched"] == name)
        ranked = [np.argsort(-(q @ vectors.T), kind="stable")[:K] for q in queries]
        assert found["overlap"] == pytest.approx(np.mean([len(set(r) & f) / K for r, f in zip(ranked, reference)]),
                                                 abs=1 / (K * QUESTIONS) + 1e-9)  # one tie may break differently
        assert found["gold_at_1"] == pytest.approx(np.mean([r[0] == g for r, g in zip(ranked, gold)]),
                                                   abs=1 / QUESTIONS + 1e-9)
        unseen = [(row in set(r)) for r, f in zip(ranked, reference) for row in f if not seen[row]]
        if unseen:
            assert found["overlap_unseen"] == pytest.approx(np.mean(unseen), abs=1 / len(unseen) + 1e-9)
    assert next(r for r in report["rankings"] if r["searched"] == "fresh")["overlap"] == 1.0

    main(["--run", str(run), "--k", str(K), "--questions", str(QUESTIONS), "--fit-hidden", "8", "--fit-steps", "3",
          "--fit-content-hidden", "8"])
    printed = capsys.readouterr().out
    assert "| unseen |" in printed and "| retrieval (dev) | corrector |" in printed
    assert "| retrieval (dev) | uniform-row probe h8 |" in printed and "cos(uniform-row probe h8, g)" in printed
    assert "| retrieval (dev) | uniform-row probe bag h8 |" in printed


def test_the_corrector_logs_its_tracking_per_step(corrector_run):
    """metrics.json's strategy_log: every logged step's cosines on the subset, against B[S] and the fresh g(S) the
    corrector loss was given; at step 1 h is the identity, so h(B) tracks exactly as well as B."""
    run, subsets = corrector_run
    log = json.loads((run / "metrics.json").read_text())["strategy_log"]
    assert log["step"] == [1, 2, 3, 4, 5, 6]
    stale = np.asarray(Buffer.open(run / "buffer").array(), dtype=np.float64)
    for step, (rows, fresh) in enumerate(subsets):
        b, g = stale[rows.numpy()], fresh.double().numpy()
        cos = np.mean(np.sum(b * g, 1) / np.linalg.norm(b, axis=1) / np.linalg.norm(g, axis=1))
        assert log["corrector/cos_stale"][step] == pytest.approx(cos, abs=1e-3)
    assert log["corrector/cos_corrected"][0] == pytest.approx(log["corrector/cos_stale"][0], abs=1e-6)
    assert log["corrector/cos_corrected"][-1] != pytest.approx(log["corrector/cos_stale"][-1], abs=1e-6)
    assert all(0 <= v <= 1 for v in log["corrector/subset_overlap@4"])


def test_offline_fit_learns_a_drift_the_stale_vectors_miss():
    """fit_offline on a synthetic drift (g = normalised B rotated): its top-1 agrees with g far more often than B's."""
    torch.manual_seed(0)
    stale = torch.nn.functional.normalize(torch.randn(400, 8), dim=1)
    rotation = torch.linalg.qr(torch.randn(8, 8)).Q
    fresh = stale @ rotation
    queries = torch.nn.functional.normalize(torch.randn(200, 8), dim=1)
    fitted = fit_offline(stale, fresh, queries, hidden=32, steps=300, temperature=0.1)
    with torch.no_grad():
        truth = (queries @ fresh.T).argmax(1)
        before = ((queries @ stale.T).argmax(1) == truth).float().mean()
        after = ((queries @ fitted(stale).T).argmax(1) == truth).float().mean()
    assert before < 0.3 and after > 0.6


def test_offline_fit_from_a_wider_source_learns_from_its_content_only():
    """fit_offline from a source of another width (token bags -> g = bags @ R): its top-1 agrees with g's far more
    often than from a constant source of the same width, which holds nothing and can only rank every query alike."""
    torch.manual_seed(0)
    bags = (torch.rand(400, 60) < 0.2).float()
    fresh = torch.nn.functional.normalize(bags @ torch.randn(60, 8), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(200, 8), dim=1)
    truth = (queries @ fresh.T).argmax(1)
    agreement = {}
    for name, source in {"bags": bags, "constant": torch.ones(400, 60)}.items():
        fitted = fit_offline(source, fresh, queries, hidden=64, steps=300, temperature=0.1)
        with torch.no_grad():
            agreement[name] = ((queries @ fitted(source).T).argmax(1) == truth).float().mean().item()
    assert agreement["bags"] > 0.6 and agreement["constant"] <= max((truth == t).float().mean().item() for t in truth)


def test_token_bags_hold_each_texts_tokens(toy_tokenizer):
    """token_bags against the tokenizer's ids read one text at a time (the set of ids within max_length)."""
    from rag_lab.analysis.diagnose_retriever import token_bags

    texts = ["Ada Lovelace works at Zalon Textiles", "born in 1815", "Ada Ada Ada"]
    bags = token_bags(toy_tokenizer, texts, max_length=4)
    assert bags.shape == (3, len(toy_tokenizer))
    for text, bag in zip(texts, bags):
        ids = toy_tokenizer(text, add_special_tokens=False)["input_ids"][:4]
        assert set(torch.nonzero(bag).flatten().tolist()) == set(ids)


def test_content_probe_against_a_ridge_solved_by_numpy_and_its_two_limits():
    """Vectors that are the bags themselves identify every held-out passage; constant vectors predict one bag for
    every row, so exactly one held-out row (1 / held-out) is nearest to its own; a random projection of the bags
    matches a ridge solved independently with numpy on the same halves."""
    from rag_lab.analysis.diagnose_retriever import content_probe

    generator = torch.Generator().manual_seed(0)
    bags = (torch.rand(200, 60, generator=generator) < 0.2).float()
    assert len({tuple(b.tolist()) for b in bags}) == 200
    assert content_probe(bags, bags)["self_at_1"] == 1.0
    assert content_probe(torch.ones(200, 4), bags)["self_at_1"] == pytest.approx(1 / 100)

    vectors = bags @ torch.randn(60, 12, generator=generator)
    probe = content_probe(vectors, bags, seed=3, ridge=0.1)
    order = torch.randperm(200, generator=torch.Generator().manual_seed(3)).numpy()
    fit, held = order[:100], order[100:]
    x = np.hstack([vectors.double().numpy(), np.ones((200, 1))])
    y = bags.double().numpy() - bags.double().numpy()[fit].mean(0)
    gram = x[fit].T @ x[fit]
    w = np.linalg.solve(gram + 0.1 * np.trace(gram) / len(gram) * np.eye(len(gram)), x[fit].T @ y[fit])
    p = x[held] @ w
    p /= np.linalg.norm(p, axis=1, keepdims=True)
    t = y[held] / np.linalg.norm(y[held], axis=1, keepdims=True)
    sims = p @ t.T
    assert probe["self_at_1"] == pytest.approx(np.mean(sims.argmax(1) == np.arange(100)), abs=1e-6)
    assert probe["cosine"] == pytest.approx(np.mean(np.diag(sims)), abs=1e-5)
    assert 0.05 < probe["self_at_1"] < 1.0  # 12 dimensions keep part of 60 tokens: neither limit


def test_the_content_table_is_printed_for_the_runs_vectors(corrector_run, capsys):
    run, _ = corrector_run
    main(["--run", str(run), "--k", str(K), "--questions", str(QUESTIONS), "--content", "100",
          "--content-init", "tiny"])
    printed = capsys.readouterr().out
    table = printed.split("content kept")[1]
    for name in ("stale", "fresh", "corrector", "init tiny"):
        assert f"| {name} | " in table
    # the run started from the tiny random init with the run's seed: that init's buffer is the run's stale buffer
    stale, init = (next(line for line in table.splitlines() if line.startswith(f"| {n} |"))
                   for n in ("stale", "init tiny"))
    assert stale.split("|")[2:] == init.split("|")[2:]


@pytest.mark.parametrize("option", ["--content", "--fit-content-hidden"])
def test_too_large_a_bag_matrix_is_refused_before_the_corpus_pass(corrector_run, monkeypatch, option):
    import rag_lab.analysis.diagnose_retriever as module
    from rag_train.config import ConfigError

    monkeypatch.setattr(module, "MAX_BAG_CELLS", 10)
    monkeypatch.setattr(module, "embed_corpus", lambda *args, **kwargs: pytest.fail("embedded before refusing"))
    asked = {"content_rows": 50} if option == "--content" else {"fit_content_hidden": (8,)}
    with pytest.raises(ConfigError, match=f"{option} needs a dense"):
        module.diagnose(corrector_run[0], K, QUESTIONS, **asked)


def brute_force(queries: np.ndarray, vectors: np.ndarray, fresh: np.ndarray, gold, k: int) -> dict[str, float]:
    """gold@1 by argmax over the full score matrix; overlap@k by set intersection with the fresh top-k."""
    scores, reference = queries @ vectors.T, queries @ fresh.T
    top = [set(np.argsort(-row, kind="stable")[:k]) for row in scores]
    fresh_top = [set(np.argsort(-row, kind="stable")[:k]) for row in reference]
    return {"gold_at_1": float(np.mean(scores.argmax(axis=1) == np.asarray(gold))),
            "overlap": float(np.mean([len(a & b) / k for a, b in zip(top, fresh_top)]))}


def test_what_the_loop_feeds_at_every_checkpoint_against_a_brute_force_computation(corrector_run, recipe_toy_dir,
                                                                                    capsys):
    """`--checkpoints`: one entry per kept checkpoint (train.keep_checkpoints=0 kept steps 2, 4, 6), each with the
    checkpoint's own towers and corrector: the last one's towers are the saved retriever's; at every step, gold@1 and
    overlap@k of h(B) (by its formula), fresh g and stale B on train and dev questions equal numpy's argmax over the
    full score matrix; the achievable fit is a corrector of the run's width."""
    run, _ = corrector_run
    torch.set_num_threads(1)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [f"step-{s:08d}" for s in (2, 4, 6)]
    report = diagnose_checkpoints(run, k=K, limit=QUESTIONS, fit_top=4, fit_steps=30)
    assert [entry["step"] for entry in report["checkpoints"]] == [2, 4, 6]
    assert report["fit_questions"] == 200  # data.max_train_examples: every question the run trained on

    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    stale = np.asarray(Buffer.open(run / "buffer").array(), dtype=np.float64)
    dev = load_eval_set(recipe_toy_dir / "retrieval-dev.jsonl", corpus, limit=QUESTIONS)
    train = load_retrieval(recipe_toy_dir / "retrieval-train.jsonl", corpus=corpus, limit=QUESTIONS)
    questions = {"dev": (dev.questions, corpus.rows([next(iter(q)) for q in dev.qrels])),
                 "train": ([ex.question for ex in train], corpus.rows([ex.positive_ids[0] for ex in train]))}
    final = DualEncoder.load(run / "retriever").state_dict()
    for entry, step in zip(report["checkpoints"], (2, 4, 6)):
        checkpoint = run / "checkpoints" / f"step-{step:08d}"
        saved = load_file(str(checkpoint / "model.safetensors"))
        retriever = checkpoint_retriever(run, checkpoint)
        for name, tensor in retriever.state_dict().items():
            if f"retriever.{name}" in saved:
                assert torch.equal(tensor, saved[f"retriever.{name}"]), name
        moved = any(not torch.equal(final[name], tensor) for name, tensor in retriever.state_dict().items())
        assert moved == (step != 6)
        w = {key: value.double().numpy() for key, value in saved.items() if key.startswith("corrector.")}
        corrected = (stale + np.maximum(stale @ w["corrector.first.weight"].T + w["corrector.first.bias"], 0)
                     @ w["corrector.second.weight"].T + w["corrector.second.bias"])
        with torch.no_grad():
            fresh = np.concatenate([retriever.encode_passages(corpus.passages(range(s, min(s + 64, len(corpus)))))
                                    .double().numpy() for s in range(0, len(corpus), 64)])
            for split, (texts, gold) in questions.items():
                queries = retriever.encode_queries(texts).double().numpy()
                for name, vectors in {"in-loop": corrected, "fresh g": fresh, "stale": stale}.items():
                    expected = brute_force(queries, vectors, fresh, gold, K)
                    found = entry["rows"][name][split]
                    assert found["gold_at_1"] == pytest.approx(expected["gold_at_1"], abs=1 / QUESTIONS + 1e-9), \
                        (step, split, name)  # one near-tie may break differently in float32
                    assert found["overlap"] == pytest.approx(expected["overlap"], abs=1 / (K * QUESTIONS) + 1e-9)
        assert entry["rows"]["fresh g"]["dev"]["overlap"] == 1.0
        assert 0 <= entry["rows"]["achievable fit"]["train"]["gold_at_1"] <= 1

    main(["--run", str(run), "--k", str(K), "--questions", str(QUESTIONS), "--checkpoints", "4", "--fit-top", "2",
          "--fit-steps", "5"])
    printed = capsys.readouterr().out
    assert f"| step | vectors | train gold@1 | train overlap@{K} | dev gold@1 | dev overlap@{K} |" in printed
    for name in ("in-loop", "achievable fit", "fresh g", "stale"):
        assert f"| 4 | {name} | " in printed
    assert "| 2 |" not in printed and "gold + fresh top-2 rows of 200 training questions" in printed


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_the_achievable_fit_learns_a_linear_drift_from_gold_and_fresh_top_k_rows(loss):
    """fresh = a known linear map of stale: the fit on each question's gold + fresh top-8 rows (the loop's own kind
    of rows) ranks like fresh g, far above stale B, on questions it never trained on."""
    generator = torch.Generator().manual_seed(0)
    stale = torch.nn.functional.normalize(torch.randn(600, 8, generator=generator), dim=1)
    drift = torch.eye(8) + 0.8 * torch.randn(8, 8, generator=generator)
    fresh = stale @ drift
    queries = torch.nn.functional.normalize(torch.randn(400, 8, generator=generator), dim=1)
    trained, held = queries[:300], queries[300:]
    gold = (trained @ fresh.T).argmax(dim=1)
    fitted = fit_offline(stale, fresh, trained, hidden=64, steps=400, temperature=0.1,
                         targets=fit_targets(trained, fresh, gold, 8), loss=loss)
    with torch.no_grad():
        truth, after = (held @ fresh.T).topk(4).indices, (held @ fitted(stale).T).topk(4).indices
        before = (held @ stale.T).topk(4).indices

    def overlap(top):
        return (truth.unsqueeze(2) == top.unsqueeze(1)).any(dim=2).float().mean().item()

    assert overlap(before) < 0.5 and overlap(after) > 0.8, (overlap(before), overlap(after))


def test_corpus_drift_is_the_mean_cosine_between_every_pair_of_encoders(corrector_run, recipe_toy_dir):
    """`--checkpoints --drift`: step 0 is the run's stale buffer, then each checkpoint's re-embedded corpus; entry (s,
    t) is the mean over passages of the cosine of the two vectors, computed here in numpy from the checkpoints'
    towers; below the diagonal nothing, on it 1."""
    run, _ = corrector_run
    torch.set_num_threads(1)
    report = corpus_drift(run, [2, 6])
    assert report["steps"] == [0, 2, 6]
    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    vectors = [np.asarray(Buffer.open(run / "buffer").array(), dtype=np.float64)]
    with torch.no_grad():
        for step in (2, 6):
            retriever = checkpoint_retriever(run, run / "checkpoints" / f"step-{step:08d}")
            batches = [corpus.passages(range(s, min(s + 64, len(corpus)))) for s in range(0, len(corpus), 64)]
            vectors.append(np.concatenate([retriever.encode_passages(b).double().numpy() for b in batches]))
    unit = [v / np.linalg.norm(v, axis=1, keepdims=True) for v in vectors]
    for i, row in enumerate(report["cosine"]):
        assert row[:i] == [None] * i and row[i] == pytest.approx(1.0)
        for j in range(i + 1, 3):
            assert row[j] == pytest.approx(float(np.mean((unit[i] * unit[j]).sum(1))), abs=1e-5), (i, j)
    assert report["cosine"][0][2] < 0.999  # training moved the passage tower: the test compares something


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_the_offline_fit_never_reads_a_row_outside_its_pool(loss):
    """`pool`: fresh vectors changed only outside the pool give the very same fitted corrector; changed inside it,
    another one."""
    generator = torch.Generator().manual_seed(0)
    stale = torch.randn(200, 8, generator=generator)
    fresh = stale + 0.3 * torch.randn(200, 8, generator=generator)
    queries = torch.randn(50, 8, generator=generator)
    pool = torch.arange(0, 200, 2)

    def fitted(target):
        return fit_offline(stale, target, queries, hidden=16, steps=20, temperature=0.1, loss=loss, pool=pool)

    outside, inside = fresh.clone(), fresh.clone()
    outside[1::2] = torch.randn(100, 8, generator=generator)
    inside[::2] = torch.randn(100, 8, generator=generator)
    base = fitted(fresh).state_dict()
    assert all(torch.equal(base[name], value) for name, value in fitted(outside).state_dict().items())
    assert not all(torch.equal(base[name], value) for name, value in fitted(inside).state_dict().items())


def test_the_held_out_map_against_a_brute_force_computation(corrector_run, recipe_toy_dir, monkeypatch, capsys):
    """`--checkpoints ... --held-out`: g is the last checkpoint's encoder, the sources are the stale buffer and the
    earlier checkpoints; each fit draws from every row but the dev golds (found here from the dev file), has the
    in-loop width, and every reported number equals numpy's on the source's or the returned fit's vectors."""
    import rag_lab.analysis.diagnose_retriever as module
    run, _ = corrector_run
    torch.set_num_threads(1)
    fits = []

    def recording(stale, fresh, queries, hidden, steps, temperature, **options):
        fits.append((stale, options, hidden, fit_offline(stale, fresh, queries, hidden, steps, temperature, **options)))
        return fits[-1][-1]

    monkeypatch.setattr(module, "fit_offline", recording)
    report = held_out_map(run, [2, 6], k=K, limit=QUESTIONS, fit_steps=5)
    assert report["target"] == 6 and [entry["step"] for entry in report["sources"]] == [0, 2]

    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    dev = load_eval_set(recipe_toy_dir / "retrieval-dev.jsonl", corpus, limit=QUESTIONS)
    gold = np.asarray(corpus.rows([next(iter(q)) for q in dev.qrels]))
    kept = sorted(set(range(len(corpus))) - set(gold.tolist()))
    assert report["held_out_rows"] == len(set(gold.tolist()))
    width = latest_checkpoint(run)  # the run keeps its corrector in every checkpoint
    assert len(fits) == 4 and {hidden for *_, hidden, _ in fits} == {
        load_file(str(width / "model.safetensors"))["corrector.first.weight"].shape[0]}
    assert [options["loss"] for _, options, *_ in fits] == ["mse", "ce", "mse", "ce"]
    for _, options, *_ in fits:
        assert options["pool"].tolist() == kept

    target = checkpoint_retriever(run, run / "checkpoints" / "step-00000006")
    with torch.no_grad():
        fresh = np.concatenate([target.encode_passages(corpus.passages(range(s, min(s + 64, len(corpus)))))
                                .double().numpy() for s in range(0, len(corpus), 64)])
        queries = target.encode_queries(dev.questions).double().numpy()
    held = np.zeros(len(corpus), dtype=bool)
    held[gold] = True

    def expected(vectors):
        cosine = (vectors * fresh).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(fresh, axis=1)
        return {"cos_fitted": cosine[~held].mean(), "cos_held_out": cosine[held].mean(),
                **{f"dev_{name}": value for name, value in brute_force(queries, vectors, fresh, gold, K).items()}}

    for entry, (first, second) in zip(report["sources"], (fits[:2], fits[2:])):
        source = first[0]
        with torch.no_grad():
            vectors = [source.double().numpy(), *(fit(source).double().numpy() for *_, fit in (first, second))]
        for name, values in zip(("as is", "h fitted by MSE", "h fitted by the run's loss"), vectors):
            found, want = entry["rows"][name], expected(values)
            assert found["cos_fitted"] == pytest.approx(want["cos_fitted"], abs=1e-5), (entry["step"], name)
            assert found["cos_held_out"] == pytest.approx(want["cos_held_out"], abs=1e-5), (entry["step"], name)
            assert found["dev_gold_at_1"] == pytest.approx(want["dev_gold_at_1"], abs=1 / QUESTIONS + 1e-9)
            assert found["dev_overlap"] == pytest.approx(want["dev_overlap"], abs=1 / (K * QUESTIONS) + 1e-9)
    stale = np.asarray(Buffer.open(run / "buffer").array(), dtype=np.float64)
    assert np.allclose(fits[0][0].double().numpy(), stale)  # step 0 is the run's stale buffer
    assert report["fresh"]["dev_overlap"] == 1.0 and report["fresh"]["cos_held_out"] == pytest.approx(1.0)

    main(["--run", str(run), "--k", str(K), "--questions", str(QUESTIONS), "--checkpoints", "4", "6", "--held-out",
          "--fit-hidden", "8", "--fit-steps", "2"])
    printed = capsys.readouterr().out
    assert "| 6 | fresh g | " in printed and "| 0 | as is | " in printed and "| 4 | h fitted by MSE | " in printed
    assert "| 2 |" not in printed and "h: 8 hidden units" in printed

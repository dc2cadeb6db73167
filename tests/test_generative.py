"""Generative retrieval with Np Decoding (seed 003): the properties the digest lists, each against an
independent computation (HF's vanilla T5 head, a naive float64 formula, cross-entropy, per-target encoding
without padding, brute force over the valid paths), and a tiny model overfitting ~50 titles."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rag_train.config import TinyModelConfig
from rag_train.data.corpus import Corpus
from rag_train.generative.ce_table import build_ce_table, contextual_occurrences, load_ce_table, save_ce_table
from rag_train.generative.model import GenerativeT5, token_contrastive_loss
from rag_train.generative.search import rank_targets
from rag_train.generative.targets import build_targets, context_inputs
from rag_train.generative.trie import Trie
from rag_train.train.generative import OutputSpace

TINY = TinyModelConfig(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=1, num_decoder_layers=1)


@pytest.fixture(scope="module")
def world(recipe_toy_dir):
    from rag_train.data.tokenizer import load_tokenizer

    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    tokenizer = load_tokenizer(recipe_toy_dir / "tokenizer")
    return corpus, tokenizer, build_targets(corpus, tokenizer, "title")


def _model(tokenizer, seed=0, dtype=torch.float64, dropout=0.0):
    from rag_train.models.tiny import tiny_t5_config

    torch.manual_seed(seed)
    return GenerativeT5(tiny_t5_config(tokenizer, TINY, dropout_rate=dropout)).to(dtype)


@pytest.mark.parametrize("decoder_inputs", ["vocab", "ce"])
def test_np_logits_equal_vanilla_logits_with_the_vocabulary_as_ce(world, decoder_inputs):
    """One CE row per vocabulary id, equal to its embedding: Np logits and loss are HF T5's own (float64)."""
    _, tokenizer, targets = world
    model = _model(tokenizer).eval()
    inputs = tokenizer(["where was Gorar Vegapo born?", "who taught Binu Ziturin?"], padding=True, return_tensors="pt")
    labels = torch.tensor([targets.tokens[0] + [1], targets.tokens[1] + [1]], dtype=torch.long)
    vanilla = model(**inputs, labels=labels)
    model.set_ce(model.shared.weight.detach().clone(), torch.arange(model.config.vocab_size), decoder_inputs)
    np_out = model(**inputs, labels=labels)
    assert np_out.logits.shape == vanilla.logits.shape
    torch.testing.assert_close(np_out.logits, vanilla.logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(np_out.loss, vanilla.loss, rtol=1e-12, atol=1e-12)


def test_ce_rows_are_deterministic_in_eval_mode_and_contextual(world):
    """Two builds from an encoder left in train mode with dropout 0.5 agree bitwise (the build runs in eval mode);
    each occurrence equals the encoder run on that target's context alone (no padding); a token shared by two
    targets gets two different rows."""
    corpus, tokenizer, targets = world
    model = _model(tokenizer, dropout=0.5).train()
    first = contextual_occurrences(model.encoder, targets, corpus, tokenizer, 24, batch_size=16)
    second = contextual_occurrences(model.encoder, targets, corpus, tokenizer, 24, batch_size=7)
    assert model.training
    torch.testing.assert_close(first[0], second[0], rtol=0, atol=1e-12)
    assert torch.equal(first[1], second[1])
    # a first name shared by two targets: the same token in two contexts
    by_first: dict = {}
    for i, tokens in enumerate(targets.tokens):
        by_first.setdefault(tokens[0], []).append(i)
    a, b = next(ids for ids in by_first.values() if len(ids) >= 2)[:2]
    offsets = [0]
    for tokens in targets.tokens:
        offsets.append(offsets[-1] + len(tokens) + 1)
    model.eval()
    with torch.no_grad():
        for i in (a, b):
            ids = torch.tensor(context_inputs(targets, corpus, tokenizer, [i], 24))
            alone = model.encoder(input_ids=ids).last_hidden_state[0, : len(targets.tokens[i]) + 1]
            torch.testing.assert_close(first[0][offsets[i]: offsets[i + 1]], alone.float(), rtol=1e-6, atol=1e-6)
    assert first[1][offsets[a]] == first[1][offsets[b]]
    assert (first[0][offsets[a]] - first[0][offsets[b]]).abs().max() > 1e-3
    table = build_ce_table(model.encoder, targets, corpus, tokenizer, 24, 0, 5, 0, 16)
    assert table.paths[a][0] != table.paths[b][0]
    assert table.row_token[table.paths[a][0]] == table.row_token[table.paths[b][0]] == targets.tokens[a][0]


def test_kmeans_reduction_and_storage(world, tmp_path):
    """At most k rows per token, each occurrence labelled with its nearest centroid (brute force), every path
    still unique; the table stored through the buffer machinery reloads equal and refuses another encoder."""
    from rag_train.buffer.store import BufferError

    corpus, tokenizer, targets = world
    model = _model(tokenizer, dtype=torch.float32)
    table = build_ce_table(model.encoder, targets, corpus, tokenizer, 24, 3, 10, 0, 32)
    vectors, tokens = contextual_occurrences(model.encoder, targets, corpus, tokenizer, 24, 32)
    assert torch.bincount(table.row_token[1:]).max() <= 3
    rows = torch.tensor([r for path in table.paths for r in path])
    assert torch.equal(table.row_token[rows], tokens)
    for token in tokens.unique()[:10].tolist():
        own = torch.nonzero(table.row_token == token).flatten()
        members = torch.nonzero(tokens == token).flatten()
        nearest = own[torch.cdist(vectors[members], table.vectors[own]).argmin(dim=1)]
        assert torch.equal(nearest, rows[members])
    assert len({tuple(p) for p in table.paths}) == len(targets)
    saved = save_ce_table(table, tmp_path / "ce", "enc-a", targets.fingerprint)
    loaded = load_ce_table(saved.directory, "enc-a", targets.fingerprint)
    assert torch.equal(loaded.vectors, table.vectors) and loaded.paths == table.paths
    with pytest.raises(BufferError, match="model_fingerprint"):
        load_ce_table(saved.directory, "enc-b", targets.fingerprint)


def test_ce_receives_no_gradient(world):
    corpus, tokenizer, targets = world
    model = _model(tokenizer, dtype=torch.float32)
    table = build_ce_table(model.encoder, targets, corpus, tokenizer, 24, 2, 5, 0, 32)
    model.set_ce(table.vectors, table.row_token, "ce")
    before = model.ce.clone()
    assert all(p is not model.ce for p in model.parameters())
    space = OutputSpace.np_decoding(table, tokenizer.eos_token_id)
    inputs = tokenizer(["where was Gorar Vegapo born?"] * 2, return_tensors="pt")
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = model(**inputs, labels=space.labels([0, 1])).loss
    contrastive = token_contrastive_loss(model.first_output_state(inputs["input_ids"], inputs["attention_mask"]),
                                         model.ce, space.positives([0, 1], len(model.ce)))
    (loss + contrastive).backward()
    optimizer.step()
    assert not model.ce.requires_grad and model.ce.grad is None
    assert torch.equal(model.ce, before)
    assert model.decoder.block[0].layer[0].SelfAttention.q.weight.grad.abs().sum() > 0


def test_contrastive_loss_is_its_naive_form_and_cross_entropy_with_one_positive():
    torch.manual_seed(0)
    queries, rows = torch.randn(5, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
    positives = torch.rand(5, 12) < 0.3
    positives[:, 0] = True
    naive = 0.0
    for q, pos in zip(queries, positives):
        e = [math.exp(float(q @ r)) for r in rows]
        naive += -math.log(sum(x for x, p in zip(e, pos) if p) / sum(e))
    torch.testing.assert_close(token_contrastive_loss(queries, rows, positives),
                               torch.tensor(naive / 5, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    gold = torch.randint(0, 12, (5,))
    one = F.one_hot(gold, 12).bool()
    torch.testing.assert_close(token_contrastive_loss(queries, rows, one), F.cross_entropy(queries @ rows.T, gold),
                               rtol=1e-12, atol=1e-12)


def test_trie_matches_brute_force(world):
    _, tokenizer, targets = world
    paths = [tokens + [1] for tokens in targets.tokens]
    trie = Trie(paths)
    for path in paths[:40]:
        for cut in range(len(path) + 1):
            prefix = path[:cut]
            expected = {p[cut] for p in paths if len(p) > cut and p[:cut] == prefix}
            assert set(trie.allowed(prefix)) == expected
        assert trie.target(path) == paths.index(path)
    assert trie.allowed([99999]) == [] and trie.target(paths[0][:-1]) is None
    with pytest.raises(ValueError, match="same output path"):
        Trie([[5, 1], [5, 1]])


@pytest.mark.parametrize("np_decoding", [False, True])
def test_every_beam_output_is_a_valid_identifier(world, np_decoding):
    """Raw beams of an untrained model under the trie: each is exactly one target's full path (checked against
    the set of paths, not the trie), and the ranking reads them back as distinct targets."""
    corpus, tokenizer, targets = world
    model = _model(tokenizer, seed=3, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    if np_decoding:
        table = build_ce_table(model.encoder, targets, corpus, tokenizer, 24, 2, 5, 0, 32)
        model.set_ce(table.vectors, table.row_token)
        space = OutputSpace.np_decoding(table, eos)
    else:
        space = OutputSpace.vanilla(targets, eos)
    valid = {tuple(p) for p in space.paths}
    questions = [f"where was {name} born?" for name in targets.names[:6]]
    batch = tokenizer(questions, padding=True, return_tensors="pt")
    out = model.generate(**batch, num_beams=8, num_return_sequences=8, max_new_tokens=max(map(len, space.paths)),
                         prefix_allowed_tokens_fn=space.trie.prefix_allowed_tokens_fn(1, 0), eos_token_id=space.end_ids,
                         pad_token_id=0, decoder_start_token_id=0, length_penalty=0.0)
    ends = set(space.end_ids)
    for sequence in out[:, 1:].tolist():
        stop = next(i for i, token in enumerate(sequence) if token in ends)
        assert tuple(sequence[: stop + 1]) in valid
        assert all(token == 0 for token in sequence[stop + 1:])
    ranked = rank_targets(model, tokenizer, questions, space.trie, space.end_ids, 8, 32, 3)
    assert all(len(r) == len(set(r)) == 8 for r in ranked)


@pytest.mark.slow
def test_tiny_model_overfits_fifty_titles(recipe_toy_dir, tmp_path):
    """Np Decoding (BASE) on the 150 titles of a 300-passage world, trained on questions about 50 of them, reaches
    100% recall@1 on those training questions; metrics.json and the CE pointer are written."""
    from rag_train.config import load_config
    from rag_train.generative.config import GenerativeConfig
    from rag_train.train.generative import train_generative

    train = tmp_path / "train.jsonl"
    rows = [json.loads(line) for line in (recipe_toy_dir / "retrieval-train.jsonl").read_text().splitlines()]
    chosen, seen = [], set()
    for row in rows:
        title = row["positive_ctxs"][0]["title"]
        if title not in seen and len(seen) < 50:
            seen.add(title)
            chosen.append(row)
    train.write_text("".join(json.dumps(row) + "\n" for row in chosen))
    cfg = load_config(GenerativeConfig, None, [
        f"data.toy_dir={recipe_toy_dir}", "data.toy_passages=300", f"data.train={train}", f"data.dev=[{train}]",
        "generator.tiny.d_model=64", "generator.tiny.d_ff=128", "generator.tiny.num_heads=4",
        "generator.tiny.num_layers=1", "generator.tiny.num_decoder_layers=1", "targets.context_length=24",
        "np.clusters_per_token=2", "train.steps=200", "train.batch_size=25", "train.lr=3e-3", "train.warmup_steps=20",
        "train.tracker=null", f"train.output_dir={tmp_path / 'run'}", "eval.num_beams=5", "eval.recall_at=[1,5]"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster, and immune to a loaded machine
    try:
        metrics = train_generative(cfg)
    finally:
        torch.set_num_threads(threads)
    assert metrics["targets"] == 150 and metrics["datasets"]["train"]["questions"] == 50
    assert metrics["recall"]["1"] == 1.0 and metrics["r_precision"] == 1.0
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["recall"] == metrics["recall"]
    assert (tmp_path / "run" / "generator" / "ce.json").is_file()


@pytest.mark.slow
def test_a_two_gold_question_trains_on_both_titles(recipe_toy_dir, tmp_path):
    """Multi-hop questions (mentor_bridge: the named person's passage and the mentor's) train one pair per gold title:
    a tiny model overfitting 20 of them ranks both titles in its top 2 (R-precision >= 0.85); trained on the first gold
    only it could reach at most 0.5."""
    from rag_train.config import load_config
    from rag_train.generative.config import GenerativeConfig
    from rag_train.train.generative import train_generative

    passages = {row["id"]: row for row in map(json.loads, (recipe_toy_dir / "passages.jsonl").read_text().splitlines())}
    questions = [json.loads(line) for line in (recipe_toy_dir / "mentor_bridge-train.jsonl").read_text().splitlines()]
    chosen = [q for q in questions if len({passages[g]["title"] for g in q["gold_ids"]}) == 2][:20]
    train = tmp_path / "bridge.jsonl"
    train.write_text("".join(json.dumps({"question": q["question"], "answers": q["answers"], "positive_ctxs": [
        {"passage_id": g, "title": passages[g]["title"], "text": passages[g]["text"]} for g in q["gold_ids"]]}) + "\n"
        for q in chosen))
    cfg = load_config(GenerativeConfig, None, [
        f"data.toy_dir={recipe_toy_dir}", "data.toy_passages=300", f"data.train={train}", f"data.dev=[{train}]",
        "generator.tiny.d_model=64", "generator.tiny.d_ff=128", "generator.tiny.num_heads=4",
        "generator.tiny.num_layers=1", "generator.tiny.num_decoder_layers=1", "np.enabled=false", "train.steps=200",
        "train.batch_size=20", "train.lr=1e-2", "train.warmup_steps=10", "train.tracker=null",
        f"train.output_dir={tmp_path / 'run'}", "eval.num_beams=4", "eval.recall_at=[2]"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        metrics = train_generative(cfg)
    finally:
        torch.set_num_threads(threads)
    assert metrics["datasets"]["bridge"]["questions"] == 20
    assert metrics["r_precision"] >= 0.85 and metrics["recall"]["2"] == metrics["r_precision"]  # R = 2 = k


def test_real_data_config_fails_clearly_offline(monkeypatch, tmp_path):
    """configs/generative/nq_titles_t5_base.yaml offline: the hub checkpoint is named before any data is read."""
    from pathlib import Path

    from rag_train.config import load_config
    from rag_train.generative.config import GenerativeConfig
    from rag_train.models.reader import ReaderLoadError
    from rag_train.train.generative import train_generative

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = Path(__file__).resolve().parent.parent / "configs" / "generative" / "nq_titles_t5_base.yaml"
    cfg = load_config(GenerativeConfig, config, [f"train.output_dir={tmp_path / 'run'}", "train.tracker=null"])
    cfg.train.mixed_precision = "no"  # the process's accelerate state may already exist (other tests), fixed
    with pytest.raises(ReaderLoadError, match=r"google/t5-base-lm-adapt.*huggingface-cli download"):
        train_generative(cfg)


@pytest.mark.slow
def test_async_run_resumes_to_the_uninterrupted_weights(recipe_toy_dir, tmp_path):
    """ASYNC rebuilds the CE every 2 steps; a run killed after its step-4 checkpoint and resumed ends on the same
    weights and the same CE table as 6 steps in one go (the checkpoint's CE pointer, the step-indexed data order
    and the rebuild schedule), and with the same metrics.json `history` and `ce_builds` (the history was
    [] after a resume and the builds before it were lost)."""
    import shutil

    from safetensors.torch import load_file

    from rag_train.config import load_config
    from rag_train.generative.config import GenerativeConfig
    from rag_train.train.generative import train_generative

    def run(name, resume=False):
        cfg = load_config(GenerativeConfig, None, [
            f"data.toy_dir={recipe_toy_dir}", "data.toy_passages=300", "data.max_train_examples=64",
            "data.max_eval_examples=4", "generator.tiny.d_model=32", "generator.tiny.d_ff=64",
            "generator.tiny.num_heads=4", "generator.tiny.num_layers=1", "generator.tiny.num_decoder_layers=1",
            "targets.context_length=24", "np.variant=async", "np.clusters_per_token=2", "np.rebuild_every_epochs=0.25",
            "train.steps=6", "train.batch_size=8", "train.tracker=null", f"train.resume={str(resume).lower()}",
            f"train.output_dir={tmp_path / name}", "eval.num_beams=2", "eval.recall_at=[1]", "train.eval_every=2",
            "train.save_every=2"])
        return train_generative(cfg)

    whole = run("whole")
    killed = tmp_path / "killed"  # as if killed after the step-4 checkpoint
    # its CE tables are left behind: the resumed run rebuilds the step-4 one (the checkpoint points at the step-2 one)
    shutil.copytree(tmp_path / "whole", killed,
                    ignore=shutil.ignore_patterns("step-00000006", "generator", "metrics.json", "ce"))
    resumed = run("killed", resume=True)
    assert [b["step"] for b in whole["ce_builds"]] == [0, 2, 4]
    assert [b["step"] for b in resumed["ce_builds"]] == [0, 2, 4]  # the checkpoint's table is not counted again
    assert [Path(b["directory"]).name for b in resumed["ce_builds"]] == [Path(b["directory"]).name
                                                                         for b in whole["ce_builds"]]
    assert [h["step"] for h in whole["history"]] == [0, 2, 4] and resumed["history"] == whole["history"]
    assert json.loads((killed / "metrics.json").read_text())["history"] == whole["history"]
    a = load_file(str(tmp_path / "whole" / "generator" / "model.safetensors"))
    b = load_file(str(killed / "generator" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_processes_rebuild_the_same_ce_and_rank_every_question(recipe_toy_dir, tmp_path):
    """2 gloo processes (DDP): each ASYNC rebuild passes the cross-process check that both encoders are identical
    (`TrainingRun.agree`, else the run fails), and the dev questions, split unevenly, are all ranked once."""
    import os
    import subprocess

    from rag_train.launch import launch_command

    root = Path(__file__).resolve().parent.parent
    cmd = launch_command(root / "scripts" / "train_generative.py", f"data.toy_dir={recipe_toy_dir}",
                         "data.toy_passages=300", "data.max_train_examples=32", "data.max_eval_examples=9",
                         "generator.tiny.d_model=32", "generator.tiny.d_ff=64", "generator.tiny.num_heads=4",
                         "generator.tiny.num_layers=1", "generator.tiny.num_decoder_layers=1",
                         "targets.context_length=24",
                         "np.variant=async", "np.rebuild_every_epochs=0.5", "train.steps=6", "train.batch_size=8",
                         "train.tracker=null", f"train.output_dir={tmp_path / 'two'}", "eval.num_beams=2",
                         "eval.recall_at=[1]", processes=2)
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["datasets"]["retrieval"]["questions"] == 9
    assert [b["step"] for b in metrics["ce_builds"]] == [0, 2, 4]
    assert len({b["directory"] for b in metrics["ce_builds"]}) == 3


def test_contra_positives_are_the_rows_of_the_targets_own_tokens(world):
    """CONTRA's positives for a target (seed 003: the CE embeddings of the target's own tokens) are, for every target,
    the rows its identifier tokens land in when its context is encoded alone and each occurrence is given the nearest
    row of its own token (brute force over the reduced table): never its end row, never another token's rows."""
    corpus, tokenizer, targets = world
    model = _model(tokenizer, dtype=torch.float32).eval()
    table = build_ce_table(model.encoder, targets, corpus, tokenizer, 24, 3, 10, 0, 32)
    ids = list(range(len(targets)))
    mask = OutputSpace.np_decoding(table, tokenizer.eos_token_id).positives(ids, len(table.vectors))
    with torch.no_grad():
        for t in ids:
            tokens = targets.tokens[t]
            inputs = torch.tensor(context_inputs(targets, corpus, tokenizer, [t], 24))
            states = model.encoder(input_ids=inputs).last_hidden_state[0, : len(tokens)]
            expected = set()
            for token, state in zip(tokens, states):
                own = torch.nonzero(table.row_token == token).flatten()
                expected.add(int(own[torch.cdist(state[None], table.vectors[own]).argmin()]))
            assert set(torch.nonzero(mask[t]).flatten().tolist()) == expected, t
            assert not mask[t, table.end_rows(tokenizer.eos_token_id)].any()


@pytest.mark.slow
def test_contra_moves_the_ce_rows_and_base_keeps_its_table(recipe_toy_dir, tmp_path):
    """End to end: CONTRA's table after its contrastive steps is the CE of the encoder those steps trained (rebuilt
    here from that step's checkpoint) and its rows moved from the initial table; BASE trains its encoder but keeps
    the initial table to the end (one build; the final encoder's CE would differ)."""
    from safetensors.torch import load_file

    from rag_train.config import load_config
    from rag_train.data.tokenizer import load_tokenizer
    from rag_train.generative.config import GenerativeConfig
    from rag_train.train.generative import train_generative

    def run(name, *extra):
        return train_generative(load_config(GenerativeConfig, None, [
            f"data.toy_dir={recipe_toy_dir}", "data.toy_passages=300", "data.max_train_examples=64",
            "data.max_eval_examples=4", "generator.tiny.d_model=32", "generator.tiny.d_ff=64",
            "generator.tiny.num_heads=4", "generator.tiny.num_layers=1", "generator.tiny.num_decoder_layers=1",
            "targets.context_length=24", "np.clusters_per_token=2", "train.batch_size=8", "train.lr=1e-2",
            "train.warmup_steps=0", "train.tracker=null", f"train.output_dir={tmp_path / name}",
            "eval.num_beams=2", "eval.recall_at=[1]", *extra]))

    def ce_of(generator):
        return build_ce_table(generator.encoder, targets, corpus, tokenizer, 24, 2, 20, 0, 64)

    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    tokenizer = load_tokenizer(recipe_toy_dir / "tokenizer")
    targets = build_targets(corpus, tokenizer, "title")
    contra = run("contra", "np.variant=contra", "np.contrastive_steps=4", "train.steps=2", "train.save_every=4")
    assert [b["step"] for b in contra["ce_builds"]] == [0, 4]
    initial, rebuilt = (load_ce_table(Path(b["directory"])) for b in contra["ce_builds"])
    generator = GenerativeT5.from_pretrained(tmp_path / "contra" / "generator").eval()  # the run's shape
    weights = load_file(str(tmp_path / "contra" / "checkpoints" / "step-00000004" / "model.safetensors"))
    loaded = generator.load_state_dict({k.removeprefix("generator."): v for k, v in weights.items()}, strict=False)
    assert not loaded.unexpected_keys  # and only the tied copies of `shared` are absent from the checkpoint:
    assert set(loaded.missing_keys) == {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
    expected = ce_of(generator)
    assert rebuilt.paths == expected.paths
    torch.testing.assert_close(rebuilt.vectors, expected.vectors, rtol=1e-5, atol=1e-5)
    assert (rebuilt.vectors - initial.vectors).abs().mean() > 0.1 * initial.vectors.abs().mean()

    base = run("base", "train.steps=6")
    assert [b["step"] for b in base["ce_builds"]] == [0]
    final = GenerativeT5.from_pretrained(tmp_path / "base" / "generator").eval()
    pointer = json.loads((tmp_path / "base" / "generator" / "ce.json").read_text())
    assert Path(pointer["directory"]).resolve() == Path(base["ce_builds"][0]["directory"]).resolve()
    kept, now = load_ce_table(Path(pointer["directory"])), ce_of(final)
    assert (now.vectors - kept.vectors).abs().mean() > 0.1 * kept.vectors.abs().mean()


def test_async_rebuilds_every_n_epochs_counted_in_examples():
    """By hand: 8 epochs of 6,000 pairs at batch 32 = 48,000 / 32 = 1,500 steps (not 8 x 187 = 1,496, an epoch
    rounded down first, whose 4th rebuild fell 16 steps before a 6,000-step run's end); at least one step."""
    from rag_train.train.generative import rebuild_interval

    assert rebuild_interval(8, 6000, 32) == 1500
    assert rebuild_interval(2, 60, 8) == 15 and rebuild_interval(0.25, 64, 8) == 2
    assert rebuild_interval(0.01, 10, 32) == 1


def test_ranking_metrics_by_hand():
    """R-precision with R = |gold| and recall@k, an empty ranking counted as a miss (computed by hand)."""
    from rag_train.generative.search import ranking_metrics

    out = ranking_metrics([[1, 2, 3], [5, 4], []], [[2], [4, 5], [9]], [1, 2])
    assert out["r_precision"] == pytest.approx(1 / 3)  # q0: 1 not gold; q1: top-2 = both gold; q2: nothing
    assert out["recall"]["1"] == pytest.approx((0 + 0.5 + 0) / 3)
    assert out["recall"]["2"] == pytest.approx((1 + 1 + 0) / 3)

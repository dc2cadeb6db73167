"""Algorithm 2 end to end on a 300-passage toy world: strategies, metrics.json, the PDist stop-gradient,
resume = uninterrupted run, a 2-process run."""

from __future__ import annotations

import json
import os
import re
import string
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rag_train.train.rlm as rlm
from rag_train.config import TinyModelConfig, load_config
from rag_train.launch import launch_command
from rag_train.losses import perplexity_distillation
from rag_train.models.retriever import DualEncoder
from rag_train.train.curves import STRATEGY_PLOT
from rag_train.train.schema import RLMConfig

from conftest import read_by

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "toy" / "rlm.yaml"
STEPS, TOP_K = 4, 4


def overrides(toy_dir: Path, out: Path, name: str, steps: int = STEPS, **extra) -> list[str]:
    tiny = {"d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 1}
    values = {**read_by(name, {
        "data.toy_dir": toy_dir, "data.toy_passages": 300, "data.max_eval_examples": 8, "data.max_train_examples": 200,
        **{f"retriever.tiny.{k}": v for k, v in tiny.items()}, "retriever.max_passage_length": 48,
        **{f"reader.tiny.{k}": v for k, v in tiny.items()}, "reader.tiny.num_decoder_layers": 1,
        "reader.max_input_length": 48, "reader.max_answer_length": 6,
        "warm_start.reader_steps": 2, "warm_start.retriever_steps": 2, "warm_start.retriever_batch_size": 4,
        "train.output_dir": out, "train.steps": steps, "train.batch_size": 4, "train.tracker": "null",
        "train.eval_every": 0, "train.log_every": 1, "strategy.name": name, "strategy.top_k": TOP_K,
        "strategy.refresh_every": 2, "strategy.corrector.hidden": 16, "buffer.shard_rows": 128,
        "buffer.embed_batch_size": 64, "eval.batch_size": 16, "pdist_gate": 0.0,
        "min_embedding_spread": 0.0}), **extra}
    return [f"{key}={value}" for key, value in values.items()]


def config(*args, **kwargs) -> RLMConfig:
    return load_config(RLMConfig, CONFIG, overrides(*args, **kwargs))


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    reader = load_file(str(run_dir / "reader" / "model.safetensors"))
    retriever = DualEncoder.load(run_dir / "retriever").state_dict()
    return {**{f"reader.{k}": v for k, v in reader.items()}, **{f"retriever.{k}": v for k, v in retriever.items()}}


def squad_normalize(text: str) -> str:
    """SQuAD v1.1's normalize_answer, as its official evaluation script writes it."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def hand_metrics(run_dir: Path, passages_file: Path) -> dict[str, dict]:
    """EM and answer recall recomputed from the run's predictions/ alone: SQuAD normalisation for EM; an answer
    is found when its word sequence occurs in a read passage's text (words and single symbols, lower case)."""
    texts = {row["id"]: row["text"] for row in map(json.loads, passages_file.read_text().splitlines())}

    def words(text: str) -> list[str]:
        return re.findall(r"\w+|[^\w\s]", text.lower())

    def found(text: str, answer: str) -> bool:
        hay, needle = words(text), words(answer)
        return bool(needle) and any(hay[i:i + len(needle)] == needle for i in range(len(hay) - len(needle) + 1))

    out = {}
    for name in ("nq", "tqa", "hotpotqa"):
        rows = [json.loads(line) for line in (run_dir / "predictions" / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == 8  # data.max_eval_examples
        out[name] = {
            "em": sum(squad_normalize(r["prediction"]) in {squad_normalize(a) for a in r["answers"]} for r in rows) / 8,
            "recall": sum(any(found(texts[pid], a) for pid in r["passages"] for a in r["answers"]) for r in rows) / 8,
            "passages": {len(r["passages"]) for r in rows},
        }
    return out


@pytest.mark.parametrize("name", ["corrector", "stale", "frozen", "exhaustive", "closed_book"])
def test_strategies_train_and_write_metrics(recipe_toy_dir, tmp_path, monkeypatch, name):
    calls = []

    def recording(retriever_scores, reader_loglik, *args):
        calls.append((retriever_scores.requires_grad, reader_loglik.requires_grad, tuple(reader_loglik.shape)))
        return perplexity_distillation(retriever_scores, reader_loglik, *args)

    monkeypatch.setattr(rlm, "perplexity_distillation", recording)
    extra = {"buffer.dtype": "float32"}
    if name == "stale":  # evaluations during training over the stale buffer: no corpus pass each
        extra.update({"train.eval_every": 2, "eval.fresh_rows": 0})
    result = rlm.train_rlm(config(recipe_toy_dir, tmp_path / "run", name, **extra))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    passes = [(p["reason"], p["rows"]) for p in metrics["corpus_passes"]]
    if name == "closed_book":  # no buffer, no retrieval at eval: the warm start's recall is the one pass
        assert passes == [("warm-start retriever's dev recall (no stale buffer)", 300)]
    else:  # the corpus tokenised once; the buffer once (it also gives the warm start's recall), the exact final
        # evaluation once, both reading the token ids
        assert passes == [("token cache build", 300), ("stale buffer build", 300), ("final evaluation", 300)]
    if name == "stale":
        assert [entry["step"] for entry in metrics["history"]] == [0, 2, STEPS]
        check_warm_start_recall(recipe_toy_dir, tmp_path / "run", metrics["warm_start_retriever"])
    by_hand = hand_metrics(tmp_path / "run", recipe_toy_dir / "passages.jsonl")
    assert metrics["em"] == pytest.approx({name: m["em"] for name, m in by_hand.items()}, abs=1e-12)
    recall = metrics[f"answer_recall@{TOP_K}"]
    if name == "closed_book":
        assert all(v is None for v in recall.values()) and calls == []  # no passages, no retriever loss
        assert not (tmp_path / "run" / "eval").exists()
    else:
        assert recall == pytest.approx({name: m["recall"] for name, m in by_hand.items()}, abs=1e-12)
        assert all(m["passages"] == {TOP_K} for m in by_hand.values())
        _check_run_file(tmp_path / "run", recipe_toy_dir, metrics)
    assert metrics["steps"] == STEPS and metrics["wall_seconds"] > 0 and metrics["strategy"] == name
    assert metrics["reembedded_passages"] == (300 * STEPS // 2 if name == "exhaustive" else 0)
    assert result["em"] == metrics["em"]
    log = metrics["strategy_log"]  # the corrector's in-loop drift per logged step (every step), and its figure
    if name == "corrector":
        assert log["step"] == list(range(1, STEPS + 1))
        assert {key: len(values) for key, values in log.items()} == dict.fromkeys(
            ["step", "corrector/cos_stale", "corrector/cos_corrected", "corrector/subset_overlap@4"], STEPS)
    assert (tmp_path / "run" / STRATEGY_PLOT).is_file() == bool(log)
    if name in ("corrector", "stale", "exhaustive"):  # retriever trained by PDist every step (gate = 1)
        assert len(calls) == STEPS
        assert all(scores_grad and not loglik_grad and shape == (4, TOP_K) for scores_grad, loglik_grad, shape in calls)
    if name == "frozen":  # never trained: the saved retriever is the warm-start one
        frozen = DualEncoder.load(tmp_path / "run" / "retriever").fingerprint()
        assert frozen == DualEncoder.load(tmp_path / "run" / "warm_start_retriever" / "retriever").fingerprint()


def _check_run_file(run_dir: Path, toy_dir: Path, metrics: dict) -> None:
    """The final evaluation's TREC run for nq: DPR answer recall and recall@k against the gold ids, by hand
    from the file's rank column, equal the reported figures."""
    from rag_train.data.corpus import Corpus
    from rag_train.eval.metrics import has_answer

    corpus = Corpus.open(toy_dir / "passages.jsonl")
    ranked: dict[str, list[str]] = {}
    for line in (run_dir / "eval" / f"step-{STEPS}" / "nq.trec").read_text().splitlines():
        qid, _, docid, rank, _, _ = line.split()
        ranked.setdefault(qid, []).append(docid)
        assert int(rank) == len(ranked[qid])
    questions = {r["id"]: r for r in map(json.loads, (toy_dir / "nq-dev.jsonl").read_text().splitlines())}
    assert len(ranked) == 8 and all(len(docs) == TOP_K for docs in ranked.values())
    hits = [any(has_answer(corpus.text(corpus.row(d)), questions[q]["answers"]) for d in docs)
            for q, docs in ranked.items()]
    assert metrics[f"answer_recall@{TOP_K}"]["nq"] == pytest.approx(sum(hits) / len(hits), abs=1e-12)
    final = metrics["history"][-1]["nq"]
    gold = [len(set(questions[q]["gold_ids"]) & set(docs)) / len(questions[q]["gold_ids"])
            for q, docs in ranked.items()]
    assert final[f"recall@{TOP_K}"] == pytest.approx(sum(gold) / len(gold), abs=1e-12)


def check_warm_start_recall(toy_dir: Path, run_dir: Path, over_buffer: dict) -> None:
    """The warm start's dev recall read off the (float32) stale buffer equals a fresh corpus pass."""
    from accelerate import Accelerator

    from rag_train.data.corpus import Corpus
    from rag_train.data.sources import dataset_name
    from rag_train.eval.retrieval import evaluate_retrieval, load_eval_set

    corpus = Corpus.open(toy_dir / "passages.jsonl")
    path = toy_dir / "retrieval-dev.jsonl"
    sets = {dataset_name(path): load_eval_set(path, corpus, limit=200)}
    retriever = DualEncoder.load(run_dir / "warm_start_retriever" / "retriever")
    fresh = evaluate_retrieval(retriever, corpus, sets, [1, 5, 10, 20, 100], Accelerator(cpu=True), 64)
    assert over_buffer == json.loads(json.dumps(fresh)) and next(iter(fresh.values()))["recall"]["1"] > 0


def test_corrector_trains_on_its_deeper_candidates(recipe_toy_dir, tmp_path, monkeypatch):
    """strategy.corrector.candidates > top_k: the reader and PDist read the top_k, the corrector loss sees the
    corrector's top-`candidates` (the same first rows, then deeper ones), each with its fresh g(y)."""
    from rag_train.losses import retrieval_scores
    from rag_train.strategies.corrector import CorrectorStrategy

    seen, pdist_shapes = [], []
    original = CorrectorStrategy.auxiliary_loss

    def recording(self, queries, rows, fresh_vectors, fresh_scores):
        retriever = self.ctx.model
        with torch.no_grad():  # the live retriever, in the training step's mode
            expected = retriever.encode_passages([p for r in rows.tolist() for p in self.ctx.corpus.passages(r)])
            corrected = self.corrector(self.stale_vectors(rows).to(queries))
        seen.append((rows.clone(), torch.allclose(fresh_vectors, expected.view_as(fresh_vectors), atol=1e-5),
                     torch.allclose(fresh_scores, retrieval_scores(queries, fresh_vectors)),
                     bool((retrieval_scores(queries, corrected).diff(dim=1) <= 1e-5).all())))
        return original(self, queries, rows, fresh_vectors, fresh_scores)

    def pdist(retriever_scores, reader_loglik, *args):
        pdist_shapes.append(tuple(reader_loglik.shape))
        return perplexity_distillation(retriever_scores, reader_loglik, *args)

    monkeypatch.setattr(CorrectorStrategy, "auxiliary_loss", recording)
    monkeypatch.setattr(rlm, "perplexity_distillation", pdist)
    rlm.train_rlm(config(recipe_toy_dir, tmp_path / "run", "corrector", **{
        "strategy.corrector.candidates": 10}))
    assert pdist_shapes == [(4, TOP_K)] * STEPS
    assert len(seen) == STEPS
    for rows, fresh_ok, scores_ok, ranked in seen:
        assert rows.shape == (4, 10) and all(len(set(r)) == 10 for r in rows.tolist())
        assert fresh_ok and scores_ok
        assert ranked  # in the corrector's own order: the reader's top_k are its first columns


def brute_force_tracking(run: Path, corpus, path: Path, k: int, limit: int) -> dict[str, dict]:
    """diagnose_rlm's tracking numbers computed independently: every passage embedded alone, the corrector
    h(b) = b + W2 relu(W1 b + c1) + c2 written out, float64 numpy scores, a full stable sort per question."""
    import numpy as np

    from rag_train.buffer.store import Buffer
    from rag_train.data.qa import load_qa

    retriever = DualEncoder.load(run / "retriever").eval()
    with torch.no_grad():
        fresh = np.stack([retriever.encode_passages([p])[0].double().numpy()
                          for p in corpus.passages(range(len(corpus)))])
        examples = [ex for ex in load_qa(path, corpus=corpus, limit=limit) if ex.gold_ids]
        queries = retriever.encode_queries([ex.question for ex in examples]).double().numpy()
    buffer = Buffer.open(run / "buffer")
    stale = np.asarray(buffer.shard(0, buffer.rows), dtype=np.float64)
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())["name"]
    h = {k_.removeprefix("corrector."): v.double().numpy()
         for k_, v in load_file(str(run / "checkpoints" / latest / "model.safetensors")).items()
         if k_.startswith("corrector.")}
    hidden = np.maximum(stale @ h["first.weight"].T + h["first.bias"], 0)
    corrected = stale + hidden @ h["second.weight"].T + h["second.bias"]
    gold = [int(corpus.rows(ex.gold_ids)[0]) for ex in examples]
    top = {name: [sorted(range(len(corpus)), key=lambda r: (-row[r], r))[:k] for row in queries @ vectors.T]
           for name, vectors in {"fresh": fresh, "stale": stale, "corrector": corrected}.items()}
    return {name: {"overlap": sum(len(set(a) & set(b)) for a, b in zip(rows, top["fresh"])) / (k * len(rows)),
                   "gold_in_top_k": sum(g in r for g, r in zip(gold, rows)) / len(rows),
                   "gold_at_1": sum(g == r[0] for g, r in zip(gold, rows)) / len(rows)} for name, rows in top.items()}


def test_diagnose_rlm_tracking_and_distractor_kinds(recipe_toy_dir, tmp_path, capsys):
    """rag_lab/analysis/diagnose_rlm.py on a finished corrector run: its tracking table against an independent
    brute-force computation, and every non-gold passage a prediction read classed, against a hand-built case of
    each kind."""
    from rag_lab.analysis import diagnose_rlm as diagnose
    from rag_train.data.corpus import Corpus
    from rag_train.data.sources import resolve_data

    gold = {"title": "Vusa Zuzufus"}
    cases = [({"title": "Vusa Zuzufus"}, 11, "same person"), ({"title": "Vusa Rerihas"}, 20, "same first name"),
             ({"title": "Bihe Zuzufus"}, 30, "same family name"), ({"title": "Bihe Rerihas"}, 40, "other person"),
             ({"title": "Vusa Rerihas"}, 21, "other section")]
    for other, row, kind in cases:
        assert diagnose.distractor_kind(gold, other, 10, row) == kind

    run = tmp_path / "run"
    # a retriever lr far above the toy default, so that the stale buffer is visibly stale after 4 steps
    rlm.train_rlm(config(recipe_toy_dir, run, "corrector", retriever_lr=5e-3, **{"data.max_eval_examples": 6}))
    cfg = load_config(RLMConfig, run / "config.yaml", [])
    from accelerate import Accelerator

    files = resolve_data(cfg.data, Accelerator(cpu=True), rlm.TOY_TRAIN_SETS, rlm.TOY_DEV_SETS)
    corpus = Corpus.open(files.passages)
    table = diagnose.tracking(run, corpus, files, TOP_K, 6)
    capsys.readouterr()
    assert [(r["questions"], r["searched"]) for r in table] == [
        (q, name) for q in ("nq-train", "nq-dev") for name in ("fresh", "stale", "corrector")]
    # one row of one question: float32 vs float64 may swap rows whose scores tie at the k-th place
    slack = 1 / (TOP_K * 6)
    for q in ("nq-train", "nq-dev"):
        expected = brute_force_tracking(run, corpus, recipe_toy_dir / f"{q}.jsonl", TOP_K, 6)
        for row in (r for r in table if r["questions"] == q):
            want = expected[row["searched"]]
            assert abs(row["overlap"] - want["overlap"]) <= slack, (q, row, want)
            for key in ("gold_in_top_k", "gold_at_1"):
                assert row[key] == want[key], (q, row, want)
    assert any(expected[name]["overlap"] < 1 for name in ("stale", "corrector"))  # not a trivial agreement

    diagnose.main(["--run", str(run), "--questions", "6", "--read"])
    out = capsys.readouterr().out
    kinds, read = out.split("EM, gold + nothing else")
    rows = [line for line in kinds.splitlines() if line.startswith("| nq |") or line.startswith("| tqa |")]
    assert len(rows) == 2
    for line in rows:
        counts = [int(c) for c in line.split("|")[2].split("/")]
        questions = sum(int(case.split(": ")[1].split("/")[1]) for case in line.split("|")[3].split(", "))
        assert questions == 6 and sum(counts) in range(6 * (TOP_K - 1), 6 * TOP_K + 1)
    reads = [line for line in read.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in reads] == ["nq", "tqa", "hotpotqa"]
    # "gold + nothing else" one question at a time (hotpotqa comparisons read two passages, bridges one)
    from rag_train.data.collate import fid_inputs
    from rag_train.data.qa import load_qa
    from rag_train.data.tokenizer import load_tokenizer
    from rag_train.eval.metrics import exact_match
    from rag_train.models.reader import FiDReader

    reader, tokenizer = FiDReader.from_pretrained(run / "reader").eval(), load_tokenizer(run / "reader")
    cfg = load_config(RLMConfig, run / "config.yaml", [])
    for line in reads:
        name = line.split("|")[1].strip()
        examples = load_qa(recipe_toy_dir / f"{name}-dev.jsonl", corpus=corpus, limit=6)
        assert name != "hotpotqa" or {len(ex.gold_ids) for ex in examples} == {1, 2}
        correct = 0
        for ex in examples:
            inputs = fid_inputs(tokenizer, [ex.question], [corpus.passages(corpus.rows(ex.gold_ids))],
                                cfg.reader.max_input_length)
            with torch.no_grad():
                out = reader.generate(**inputs, max_new_tokens=cfg.reader.max_answer_length)
            correct += exact_match(tokenizer.batch_decode(out, skip_special_tokens=True)[0], ex.answers)
        assert float(line.split("|")[2]) == pytest.approx(100 * correct / len(examples), abs=0.05), name


def test_retriever_lr_sets_the_retriever_step_size(recipe_toy_dir, tmp_path):
    """AdamW's first step moves each weight by at most its lr (|m / sqrt(v)| = 1): with retriever_lr far below
    train.lr, the retriever moves by about retriever_lr and the reader by about train.lr."""
    run_dir = tmp_path / "run"
    rlm.train_rlm(config(recipe_toy_dir, run_dir, "corrector", steps=1, retriever_lr=1e-5, **{"train.lr": 5e-4}))
    start = DualEncoder.load(run_dir / "warm_start_retriever" / "retriever").state_dict()
    end = DualEncoder.load(run_dir / "retriever").state_dict()
    moved = max(float((end[name] - start[name]).abs().max()) for name in start)
    assert 0.5e-5 < moved <= 1.01e-5
    reader_start = load_file(str(run_dir / "warm_start_reader" / "model.safetensors"))
    reader_end = load_file(str(run_dir / "reader" / "model.safetensors"))
    reader_moved = max(float((reader_end[n] - reader_start[n]).abs().max()) for n in reader_start)
    assert 2.5e-4 < reader_moved <= 5.05e-4


def test_pdist_gives_the_reader_no_gradient(recipe_toy_dir):
    """Even with the reader's log-likelihoods carrying a graph, the retriever loss reaches only the retriever."""
    from rag_train.config import ReaderConfig
    from rag_train.data.collate import answer_labels, fid_inputs
    from rag_train.data.tokenizer import load_tokenizer
    from rag_train.models.reader import FiDReader

    toy_tokenizer = load_tokenizer(recipe_toy_dir / "tokenizer")

    tiny = TinyModelConfig(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=1, num_decoder_layers=1)
    reader = FiDReader.from_config(ReaderConfig(tiny=tiny), toy_tokenizer)
    passages = [[{"title": "A", "text": "alpha beta"}, {"title": "B", "text": "gamma"}]] * 2
    inputs = fid_inputs(toy_tokenizer, ["who is alpha", "what is gamma"], passages, 24)
    labels = answer_labels(toy_tokenizer, [["beta"], ["gamma"]], 6)
    out = reader(**inputs, labels=labels)
    loglik = reader.passage_log_likelihoods(inputs["input_ids"], inputs["attention_mask"], labels,
                                            encoder_states=out.encoder_last_hidden_state)
    assert loglik.requires_grad  # the graph is there: only the loss's stop-gradient can block it
    scores = torch.randn(2, 2, requires_grad=True)
    perplexity_distillation(scores, loglik, 0.1, 1.0).backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0
    assert all(p.grad is None for p in reader.parameters())


def test_retrieved_distractors_are_the_top_ranked_non_gold_rows(recipe_toy_dir):
    """The reader warm start's `retrieved` distractors against brute force over the whole corpus."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from rag_train.buffer.embed import CorpusPasses
    from rag_train.config import RetrieverConfig
    from rag_train.data.corpus import Corpus
    from rag_train.data.qa import load_qa
    from rag_train.train.warm_start import retrieved_distractors

    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    examples = load_qa(recipe_toy_dir / "mentor_bridge-train.jsonl", corpus=corpus, limit=6)  # two gold passages each
    examples += load_qa(recipe_toy_dir / "nq-train.jsonl", corpus=corpus, limit=6)
    torch.manual_seed(0)
    retriever = DualEncoder.from_config(RetrieverConfig(tiny=TinyModelConfig(d_model=32, d_ff=64, d_kv=8)),
                                        tokenizer=str(recipe_toy_dir / "tokenizer")).eval()
    run = SimpleNamespace(accelerator=Accelerator(cpu=True), passes=CorpusPasses())
    found = retrieved_distractors(retriever, corpus, examples, 3, run, None, batch_size=64)
    with torch.no_grad():
        passages = torch.cat([retriever.encode_passages(corpus.passages(range(s, min(s + 64, len(corpus)))))
                              for s in range(0, len(corpus), 64)])
        scores = (retriever.encode_queries([ex.question for ex in examples]) @ passages.T).tolist()
    for ex, row_scores, rows in zip(examples, scores, found):
        gold = set(corpus.rows(ex.gold_ids))
        expected = [r for r in sorted(range(len(corpus)), key=lambda r: (-row_scores[r], r)) if r not in gold][:3]
        assert len(set(rows)) == 3 and not gold & set(rows)
        # same rows up to float noise between batchings (ties within 1e-5 may swap)
        assert [row_scores[r] for r in rows] == pytest.approx([row_scores[r] for r in expected], abs=1e-5)


def test_a_finished_warm_start_stage_with_other_settings_is_refused(recipe_toy_dir, tmp_path):
    from rag_train.config import ConfigError
    from rag_train.train.warm_start import check_stage, record_stage

    made = config(recipe_toy_dir, tmp_path / "run", "corrector")
    for name in ("warm_start_reader", "warm_start_retriever"):
        (tmp_path / name).mkdir()
        record_stage(made, tmp_path / name, name)
        check_stage(made, tmp_path / name, name)  # same settings: reused
    changed = config(recipe_toy_dir, tmp_path / "run", "frozen", **{"warm_start.reader_lr": 0.5,
                                                                   "reader.max_input_length": 40})
    with pytest.raises(ConfigError, match=r"reader.max_input_length, warm_start.reader_lr differ"):
        check_stage(changed, tmp_path / "warm_start_reader", "warm_start_reader")
    check_stage(changed, tmp_path / "warm_start_retriever", "warm_start_retriever")  # its settings did not change
    reseeded = config(recipe_toy_dir, tmp_path / "run", "corrector", **{"train.seed": 3})
    with pytest.raises(ConfigError, match="seed"):
        check_stage(reseeded, tmp_path / "warm_start_reader", "warm_start_reader")
    shared = config(recipe_toy_dir, tmp_path / "run", "corrector", **{"train.seed": 3, "warm_start.from_run": tmp_path})
    check_stage(shared, tmp_path / "warm_start_reader", "warm_start_reader")  # other seeds may share a warm start
    (tmp_path / "unrecorded").mkdir()  # every stage records its settings: a folder without them is not one
    with pytest.raises(ConfigError, match="without stage_settings.json"):
        check_stage(made, tmp_path / "unrecorded", "warm_start_reader")


def test_resume_continues_as_if_uninterrupted(recipe_toy_dir, tmp_path):
    """Same weights and EM; metrics.json's `corpus_passes` keeps the passes made before the resume (the token cache
    and stale buffer builds, not only the passes after it)."""
    whole = rlm.train_rlm(config(recipe_toy_dir, tmp_path / "whole", "corrector", **{"train.save_every": 2}))
    rlm.train_rlm(config(recipe_toy_dir, tmp_path / "split", "corrector", steps=2))
    resumed = rlm.train_rlm(config(recipe_toy_dir, tmp_path / "split", "corrector", **{"train.resume": "true"}))
    assert resumed["steps"] == STEPS and resumed["em"] == whole["em"]
    passes = [[(p["reason"], p["rows"]) for p in m["corpus_passes"]] for m in (whole, resumed)]
    assert [p[0] for p in passes[0][:2]] == ["token cache build", "stale buffer build"] and passes[1] == passes[0], \
        passes
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "split")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bitwise on CPU


@pytest.mark.slow
def test_two_processes_match_one(recipe_toy_dir, tmp_path):
    """The same run on 2 gloo processes and on 1 (warm starts included; the reader warm start's retrieved
    distractors come from a sharded search): same metrics and predictions, weights equal within float32
    reduction-order noise (DDP averages the two halves' gradients where one process sums them at once)."""
    args = overrides(recipe_toy_dir, tmp_path / "two", "corrector", **{
        # the reader warm start's retrieved distractors: a sharded search inside a stage without collectives
        "warm_start.reader_steps": 3, "warm_start.reader_copy_steps": 1, "warm_start.reader_distractors": "retrieved"})
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # a tracker: finishing the warm-start run's trackers must not end the process group
    cmd = launch_command(str(ROOT / "scripts" / "train_rlm.py"), "--config", str(CONFIG), *args,
                         "train.tracker=tensorboard", processes=2)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]  # the root cause
    assert proc.returncode == 0, "\n".join(errors[:10]) + proc.stderr[-2000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    one = rlm.train_rlm(load_config(RLMConfig, CONFIG, [a.replace(str(tmp_path / "two"), str(tmp_path / "one"))
                                                        for a in args]))
    for key in ("steps", "em", f"answer_recall@{TOP_K}", "retriever_trained_from_step", "reembedded_passages",
                "skipped_steps"):
        assert two[key] == one[key], key
    for name in ("nq", "tqa", "hotpotqa"):
        read = [json.loads(line) for line in
                (tmp_path / "one" / "predictions" / f"{name}.jsonl").read_text().splitlines()]
        assert read == [json.loads(line) for line in
                        (tmp_path / "two" / "predictions" / f"{name}.jsonl").read_text().splitlines()], name
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)


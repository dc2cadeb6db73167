"""Our retrieval figures equal the standard tools' on the run file the evaluation wrote: pytrec_eval (called
directly, not through ir_measures), the ir_measures command line, and recall / MRR worked by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ir_measures
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import pytrec_eval
import torch

from rag_train.buffer.search import SearchResult
from rag_train.config import load_config
from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError
from rag_train.eval.metrics import ranking_metrics
from rag_train.eval.retrieval import EvalSet, load_eval_set, retrieval_metrics
from rag_train.eval.trec import make_run, write_qrels, write_run
from rag_train.train.retriever import train_retriever
from rag_train.train.schema import RetrieverTrainConfig

ROOT = Path(__file__).resolve().parents[1]
STEPS, KS = 2, [1, 5, 10, 20, 100]


def read_run_by_rank(path: Path) -> dict[str, list[tuple[str, float]]]:
    """qid -> [(docid, score)] in the file's rank-column order; checks the six-column format on the way."""
    ranked: dict[str, list[tuple[int, str, float]]] = {}
    for line in path.read_text().splitlines():
        qid, q0, docid, rank, score, tag = line.split(" ")
        assert (q0, tag) == ("Q0", "rag-train")
        ranked.setdefault(qid, []).append((int(rank), docid, float(score)))
    out = {}
    for qid, rows in ranked.items():
        assert [r for r, _, _ in rows] == list(range(1, len(rows) + 1))
        out[qid] = [(docid, score) for _, docid, score in rows]
    return out


def pytrec_figures(qrels_path: Path, run_path: Path, ks: list[int], depth: int) -> dict:
    """recall@k, MRR@10, nDCG@10 and MAP over the depth, from trec_eval's own measures via pytrec_eval."""
    qrels = {q: {d: int(r) for d, r in judged.items()} for q, judged in _read(qrels_path, qrels=True).items()}
    run = _read(run_path, qrels=False)
    # trec_eval's recip_rank has no cut-off: evaluate it on each query's first ten by trec_eval's own order
    # (score desc, then docid desc)
    top10 = {q: dict(sorted(docs.items(), key=lambda item: (item[1], item[0]), reverse=True)[:10])
             for q, docs in run.items()}
    cut = pytrec_eval.RelevanceEvaluator(qrels, {f"recall.{','.join(map(str, ks))}", "ndcg_cut.10",
                                                 f"map_cut.{depth}"}).evaluate(run)
    rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)

    def mean(values):
        return sum(values) / len(values)

    return {"recall": {str(k): mean([m[f"recall_{k}"] for m in cut.values()]) for k in ks},
            "mrr@10": mean([m["recip_rank"] for m in rr.values()]),
            "ndcg@10": mean([m["ndcg_cut_10"] for m in cut.values()]),
            f"map@{depth}": mean([m[f"map_cut_{depth}"] for m in cut.values()])}


def _read(path: Path, qrels: bool) -> dict:
    out: dict = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if qrels:
            out.setdefault(parts[0], {})[parts[2]] = int(parts[3])
        else:
            out.setdefault(parts[0], {})[parts[2]] = float(parts[4])
    return out


def test_recipe_figures_equal_pytrec_eval_and_hand_on_its_run_file(recipe_toy_dir, tmp_path):
    """Algorithm 1's final evaluation: metrics.json == pytrec_eval on `<run>/eval/step-2/retrieval.{trec,qrels}`
    == the definitions by hand on the file's ranking (rank column)."""
    overrides = {"data.toy_dir": recipe_toy_dir, "data.toy_passages": 300, "data.max_eval_examples": 25,
                 "data.max_train_examples": 50, "retriever.tiny.d_model": 32, "retriever.tiny.d_ff": 64,
                 "retriever.tiny.d_kv": 8, "retriever.tiny.num_heads": 4, "retriever.tiny.num_layers": 1,
                 "retriever.max_passage_length": 48, "train.output_dir": tmp_path / "run", "train.steps": STEPS,
                 "train.batch_size": 4, "train.tracker": "null", "train.eval_every": 0, "strategy.name": "in_batch",
                 "eval.batch_size": 64}
    cfg = load_config(RetrieverTrainConfig, ROOT / "configs" / "toy" / "retriever.yaml",
                      [f"{key}={value}" for key, value in overrides.items()])
    cfg.eval.recall_at = KS
    train_retriever(cfg)
    ours = json.loads((tmp_path / "run" / "metrics.json").read_text())["datasets"]["retrieval"]
    run_path = tmp_path / "run" / "eval" / f"step-{STEPS}" / "retrieval.trec"
    qrels_path = run_path.with_suffix(".qrels")

    ranking = read_run_by_rank(run_path)
    qrels = _read(qrels_path, qrels=True)
    assert len(ranking) == len(qrels) == ours["questions"] == 25
    assert all(len(docs) == 100 for docs in ranking.values())
    for docs in ranking.values():  # the rank column follows the scores, so every tool reads the same order
        assert all(a[1] >= b[1] for a, b in zip(docs, docs[1:]))

    reference = pytrec_figures(qrels_path, run_path, KS, depth=100)
    assert set(ours) == {"questions", "recall", "mrr@10", "ndcg@10", "map@100", "answer_recall"}
    for k in map(str, KS):
        assert ours["recall"][k] == pytest.approx(reference["recall"][k], abs=1e-12)
    for key in ("mrr@10", "ndcg@10", "map@100"):
        assert ours[key] == pytest.approx(reference[key], abs=1e-12)

    # by hand, on the rank column: recall = |gold in top k| / |gold|, MRR@10 = 1 / rank of the first gold
    by_hand_recall = {k: sum(len(set(qrels[q]) & {d for d, _ in ranking[q][:k]}) / len(qrels[q]) for q in qrels)
                      / len(qrels) for k in KS}
    by_hand_mrr = sum(next((1 / r for r, (d, _) in enumerate(ranking[q][:10], 1) if d in qrels[q]), 0.0)
                      for q in qrels) / len(qrels)
    assert ours["recall"] == pytest.approx({str(k): v for k, v in by_hand_recall.items()}, abs=1e-12)
    assert ours["mrr@10"] == pytest.approx(by_hand_mrr, abs=1e-12)
    assert 0 < ours["recall"]["100"]  # a ranking that finds something, so the comparison has content


def test_written_files_read_back_by_the_ir_measures_command_line(tmp_path):
    """Graded qrels and a score tie (trec_eval breaks it by docid): the CLI on our files gives our figures."""
    run = make_run(["q1", "q2", "q3"], [["d3", "d1", "d2"], ["d9", "d8", "d7"], ["d4", "d5", "d6"]],
                   [[2.5, 1.0, 1.0], [0.3, 0.2, 0.1], [1 / 3, 1 / 7, -0.25]])
    qrels = {"q1": {"d2": 2, "d3": 1}, "q2": {"d7": 1, "d0": 3}, "q3": {"d5": 1}}
    write_run(tmp_path / "x.trec", run)
    write_qrels(tmp_path / "x.qrels", qrels)
    ours = ranking_metrics(run, qrels, [1, 2])
    measures = ["R@1", "R@2", "RR@10", "nDCG@10", "AP@3"]
    out = subprocess.run([sys.executable, "-m", "ir_measures", str(tmp_path / "x.qrels"), str(tmp_path / "x.trec"),
                          *measures, "--places", "15"], capture_output=True, text=True, check=True).stdout
    cli = {name: float(value) for name, value in (line.split("\t") for line in out.splitlines())}
    expected = {"R@1": ours["recall"]["1"], "R@2": ours["recall"]["2"], "RR@10": ours["mrr@10"],
                "nDCG@10": ours["ndcg@10"], "AP@3": ours["map@3"]}
    assert cli == pytest.approx(expected, abs=1e-12)
    # q1's tie: trec_eval puts d2 (relevant, grade 2) before d1, so R@2 counts it, and by hand:
    assert ours["recall"]["2"] == pytest.approx((1.0 + 0 + 1) / 3)
    assert ours["mrr@10"] == pytest.approx((1 + 1 / 3 + 1 / 2) / 3)
    # the file holds the scores exactly as computed (repr round-trips)
    read_back: dict = {}
    for doc in ir_measures.read_trec_run(str(tmp_path / "x.trec")):
        read_back.setdefault(doc.query_id, {})[doc.doc_id] = doc.score
    assert read_back == run


def test_ids_that_cannot_go_in_a_trec_file_are_refused(tmp_path):
    with pytest.raises(DataError, match="passage id 'a b'"):
        write_run(tmp_path / "x.trec", make_run(["q"], [["a b"]], [[1.0]]))
    with pytest.raises(DataError, match="query id 'q' occurs twice"):
        make_run(["q", "q"], [["a"], ["b"]], [[1.0], [1.0]])
    assert not (tmp_path / "x.trec").exists()


def test_eval_sets_from_qa_and_supervised_files(recipe_toy_dir, tmp_path):
    """A plain QA file (NQ-open style) evaluates by answers and its gold_ids; a DPR file by its positives;
    the same QA rows as parquet give the same set."""
    corpus = Corpus.open(recipe_toy_dir / "passages.jsonl")
    qa_rows = [json.loads(line) for line in (recipe_toy_dir / "nq-dev.jsonl").read_text().splitlines()[:5]]
    qa = load_eval_set(recipe_toy_dir / "nq-dev.jsonl", corpus, limit=5)
    assert qa.ids == [r["id"] for r in qa_rows] and qa.answers == [r["answers"] for r in qa_rows]
    assert qa.qrels == [{g: 1 for g in r["gold_ids"]} for r in qa_rows]
    pq.write_table(pa.table({k: [r[k] for r in qa_rows] for k in qa_rows[0]}), tmp_path / "nq-dev.parquet")
    assert load_eval_set(tmp_path / "nq-dev.parquet", corpus) == qa

    dpr_rows = [json.loads(line) for line in (recipe_toy_dir / "retrieval-dev.jsonl").read_text().splitlines()[:3]]
    dpr = load_eval_set(recipe_toy_dir / "retrieval-dev.jsonl", corpus, limit=3)
    assert dpr.qrels == [{c["passage_id"]: 1 for c in r["positive_ctxs"]} for r in dpr_rows]
    assert dpr.questions == [r["question"] for r in dpr_rows]


def test_ids_with_spaces_keep_their_metrics_and_skip_the_file(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a b", "text": "one"}\n{"id": "c", "text": "two"}\n')
    corpus = Corpus.open(path)
    ranked = SearchResult(scores=torch.tensor([[0.9, 0.1]]), rows=torch.tensor([[0, 1]]))
    out = retrieval_metrics(corpus, ranked, EvalSet(["q"], ["q1"], [{"a b": 1}], [["one"]]), [1], tmp_path, "dev")
    assert out["recall"] == {"1": 1.0} and out["answer_recall"] == {"1": 1.0}
    assert not (tmp_path / "dev.trec").exists() and "passage id 'a b'" in caplog.text

"""Generative retrieval against the project's dual encoder on the same questions, scored at the same level:
the dual encoder ranks passages, read as a ranking of distinct titles (a title's best passage decides its
rank), then R-precision and recall@k as for the beams. Feeds scripts/compare_generative.py."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import yaml

from rag_train.buffer.embed import embed_rows
from rag_train.buffer.search import search
from rag_train.config import load_config
from rag_train.data.corpus import Corpus
from rag_train.data.sources import dataset_name, resolve_data
from rag_train.data.supervised import load_retrieval
from rag_train.generative.search import ranking_metrics
from rag_train.io import read_json
from rag_train.train.schema import RetrieverTrainConfig


@torch.inference_mode()
def dense_title_metrics(run_dir: str | Path, ks: Sequence[int], depth: int = 100, batch_size: int = 64) -> dict:
    """Title-level metrics of a finished `train_retriever` run (its `retriever/` folder) on its dev sets."""
    from accelerate import PartialState

    from rag_train.models.retriever import DualEncoder

    run_dir = Path(run_dir)
    cfg = load_config(RetrieverTrainConfig, run_dir / "config.yaml")
    files = resolve_data(cfg.data, PartialState(), ["retrieval-train"], ["retrieval-dev"])
    corpus = Corpus.open(files.passages)
    model = DualEncoder.load(run_dir / "retriever").eval()
    vectors = embed_rows(model, corpus, np.arange(len(corpus)), batch_size, torch.device("cpu"))
    titles = [corpus.title(row) for row in range(len(corpus))]
    out = {}
    for path in files.dev:
        examples = load_retrieval(path, corpus=corpus, limit=cfg.data.max_eval_examples)
        ranked = []
        for start in range(0, len(examples), batch_size):
            queries = model.encode_queries([ex.question for ex in examples[start:start + batch_size]]).float()
            rows = search(queries, vectors, min(depth, len(corpus)), mode="exact").rows.tolist()
            ranked += [list(dict.fromkeys(titles[r] for r in row)) for row in rows]
        gold = [list(dict.fromkeys(titles[r] for r in corpus.rows(ex.positive_ids))) for ex in examples]
        out[dataset_name(path)] = ranking_metrics(ranked, gold, ks)
    return out


def comparison_table(generative_runs: Sequence[str | Path], dense_runs: Sequence[str | Path],
                     ks: Sequence[int] = (1, 5, 10)) -> str:
    """Markdown: one line per method (decoding, or the dense run's strategy), mean and sd over its runs (seeds)
    of R-precision and recall@k on each dev set, in %."""
    results: dict[tuple[str, str], list[dict]] = {}
    for run in generative_runs:
        metrics = read_json(Path(run) / "metrics.json")
        for name, values in metrics["datasets"].items():
            results.setdefault((f"generative, {metrics['decoding']}", name), []).append(values)
    for run in dense_runs:
        strategy = yaml.safe_load((Path(run) / "config.yaml").read_text())["strategy"]["name"]
        for name, values in dense_title_metrics(run, ks).items():
            results.setdefault((f"dual encoder, {strategy}", name), []).append(values)
    lines = ["| method | dev set | runs | R-precision | " + " | ".join(f"R@{k}" for k in ks) + " |",
             "|---|---|---|---|" + "---|" * len(ks)]
    for (method, name), runs in results.items():
        cells = [_mean_sd([r["r_precision"] for r in runs])]
        cells += [_mean_sd([r["recall"][str(k)] for r in runs]) for k in ks]
        lines.append(f"| {method} | {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean_sd(values: list[float]) -> str:
    mean = 100 * statistics.fmean(values)
    return f"{mean:.1f} ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else f"{mean:.1f}"


def main(argv: Optional[list[str]] = None) -> None:
    """`scripts/compare_generative.py`: print the table of `comparison_table`."""
    parser = argparse.ArgumentParser(description="Generative retrieval runs against dual-encoder runs on the same "
                                                 "dev questions, at the title level (mean ± sd over runs).")
    parser.add_argument("--generative", nargs="*", default=[], help="train_generative.py run directories")
    parser.add_argument("--dense", nargs="*", default=[], help="train_retriever.py run directories")
    parser.add_argument("--k", nargs="+", type=int, default=[1, 5, 10], help="recall@k cut-offs")
    args = parser.parse_args(argv)
    print(comparison_table(args.generative, args.dense, args.k))

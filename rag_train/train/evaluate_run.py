"""Evaluate a finished RLM run on QA files: retrieve with its trained retriever over the corpus embedded by
that retriever, read with its FiD reader, score exact match and answer recall@k.

    python scripts/evaluate.py --run runs/toy-rlm --data data/toy/nq-dev.jsonl data/toy/tqa-dev.jsonl

Writes `<run>/eval/<dataset>.jsonl` (one prediction per question), `<run>/eval/<dataset>.trec` (the ranking, a
TREC run file; `<dataset>.qrels` beside it when questions list gold_ids) and `<run>/eval/metrics.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Optional

from rag_train.buffer.embed import use_token_cache
from rag_train.buffer.tokens import finished_token_cache, token_cache_dir
from rag_train.config import load_config
from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError
from rag_train.data.qa import load_qa
from rag_train.data.sources import dataset_name, resolve_data
from rag_train.data.tokenizer import load_tokenizer
from rag_train.data.toy import TOY_DEV_SETS, TOY_TRAIN_SETS
from rag_train.eval.qa import QAEvalSettings, evaluate_qa
from rag_train.io import atomic_write_json, verify_model_files
from rag_train.launch import make_accelerator
from rag_train.models.reader import FiDReader
from rag_train.models.retriever import DualEncoder
from rag_train.strategies import strategy_class
from rag_train.train.rlm import write_predictions
from rag_train.train.run_corpus import check_run_corpus
from rag_train.train.run_dir import lock_run_directory
from rag_train.train.schema import RLMConfig


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="RLM run directory (config.yaml, retriever/, reader/)")
    parser.add_argument("--data", nargs="*", default=None,
                        help="QA files {question, answers}; default: the run's dev sets")
    parser.add_argument("--passages", type=int, default=None, help="passages per question (default: the run's)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate at most this many questions per file")
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args(argv)

    run = Path(args.run)
    missing = [name for name in ("config.yaml", "retriever", "reader") if not (run / name).exists()]
    if missing:
        raise DataError(f"{run} is not a finished RLM run: missing {', '.join(missing)}")
    verify_model_files(run / "reader")  # before any work: a damaged reader would answer every question with ""
    cfg = load_config(RLMConfig, run / "config.yaml")
    accelerator = make_accelerator()
    lock = lock_run_directory(run, "evaluation", accelerator)  # it writes <run>/eval/: no training may write beside it
    try:
        evaluate_run(run, cfg, args, accelerator)
    finally:
        if lock is not None:
            lock.release()


def evaluate_run(run: Path, cfg: RLMConfig, args: argparse.Namespace, accelerator) -> None:
    """The evaluation itself, under the run's lock."""
    files = resolve_data(cfg.data, accelerator, TOY_TRAIN_SETS, TOY_DEV_SETS)
    corpus = Corpus.open(files.passages)
    # the corpus the retriever was trained (and its buffer built) on, not another toy world
    check_run_corpus(run, corpus, f"{run / 'config.yaml'}: data", {"buffer": {"path": cfg.buffer.path}})
    sets = {dataset_name(p): load_qa(p, corpus=corpus, limit=args.limit, empty_answers=cfg.data.empty_answers)
            for p in (args.data or files.dev)}

    retriever = DualEncoder.load(run / "retriever").to(accelerator.device)
    reader = FiDReader.from_pretrained(run / "reader").to(accelerator.device)
    tokenizer = load_tokenizer(str(run / "reader"))
    settings = QAEvalSettings.from_config(cfg, closed_book=not strategy_class(cfg.strategy.name).retrieves,
                                          num_passages=args.passages, batch_size=args.batch_size)
    with contextlib.ExitStack() as registered:  # the run's token ids, when its cache matches: no tokenising
        cache = finished_token_cache(token_cache_dir(Path(cfg.buffer.path) if cfg.buffer.path else run / "buffer"))
        if cache is not None:
            registered.enter_context(use_token_cache(cache))
        metrics, predictions = evaluate_qa(retriever, reader, tokenizer, corpus, sets, settings, accelerator,
                                           out_dir=run / "eval")
    if accelerator.is_main_process:
        write_predictions(run / "eval", predictions)
        atomic_write_json(run / "eval" / "metrics.json", metrics)
        print(json.dumps(metrics, indent=2))

"""Warm-start stages that stand in for pre-training when the toy default starts from random weights.

Reader: trained on each question's gold passage(s) mixed with random passages, so it learns to read
(T5's pre-training stand-in). Retriever: trained with Algorithm 1 on (question, gold passage) pairs
(GTR's stand-in). Both are skipped at 0 steps, and when a run resumes (its checkpoint holds the weights).

The reader stage runs the same global batch on every process (identical updates, no gradient sync):
it is a small stand-in, not a training job of its own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm
from transformers.optimization import Adafactor

from rag_train.buffer.embed import buffer_local_shard, embed_local_shard
from rag_train.config import ConfigError, flatten
from rag_train.data.collate import answer_labels, fid_inputs
from rag_train.data.corpus import Corpus
from rag_train.data.qa import QAExample
from rag_train.data.sources import DataFiles
from rag_train.eval.retrieval import rank_passages
from rag_train.io import (
    CorruptFileError,
    atomic_directory,
    atomic_write_json,
    record_model_files,
    state_bytes,
    verify_model_files,
)
from rag_train.models.retriever import DualEncoder
from rag_train.train.run import TrainingRun
from rag_train.train.schema import RetrieverTrainConfig, RLMConfig
from rag_train.train.step import global_batch, linear_warmup, seed_stage


def stage_dir(cfg: RLMConfig, run: TrainingRun, name: str) -> Path:
    """Where a warm-start stage's output lives: this run, or the run named by `warm_start.from_run`
    (which must have finished that stage: it is read, never trained again)."""
    if cfg.warm_start.from_run is None:
        return run.dir / name
    path = Path(cfg.warm_start.from_run) / name
    if not path.is_dir():
        raise FileNotFoundError(f"warm_start.from_run={cfg.warm_start.from_run}: no finished {name}/ there")
    return path


STAGE_SETTINGS = "stage_settings.json"


def stage_settings(cfg: RLMConfig, name: str) -> dict:
    """What a stage's result depends on (its warm_start keys, its model's config, the seed), as JSON values."""
    model = "reader" if name == "warm_start_reader" else "retriever"
    warm = {k: v for k, v in dataclasses.asdict(cfg.warm_start).items() if k.startswith(model)}
    settings = {"warm_start": warm, model: dataclasses.asdict(getattr(cfg, model)), "seed": cfg.train.seed}
    return json.loads(json.dumps(settings))


def record_stage(cfg: RLMConfig, out: Path, name: str, checksums: bool = False) -> None:
    """The settings a stage was made with; `checksums`: also a record of the files already in `out` (its model),
    checked before it is reused."""
    if checksums:
        record_model_files(out, exclude=(STAGE_SETTINGS,))
    atomic_write_json(out / STAGE_SETTINGS, stage_settings(cfg, name))


def check_stage(cfg: RLMConfig, out: Path, name: str) -> None:
    """A finished stage is reused only if it was made with the current settings: a changed `warm_start.*` or
    model key must not silently pick up the old result (the seed is not compared across `warm_start.from_run`)."""
    recorded = out / STAGE_SETTINGS
    if not recorded.is_file():
        raise ConfigError(f"{out} is a finished {name} without {STAGE_SETTINGS} (the settings it was made with): "
                          "delete it, or set another train.output_dir or warm_start.from_run")
    found, expected = flatten(json.loads(recorded.read_text())), flatten(stage_settings(cfg, name))
    if cfg.warm_start.from_run is not None:  # runs with other seeds may share one warm start on purpose
        found.pop("seed", None), expected.pop("seed", None)
    changed = sorted(key for key in found.keys() | expected.keys() if found.get(key) != expected.get(key))
    if changed:
        raise ConfigError(f"{out} is a finished {name} made with other settings ({', '.join(changed)} differ from "
                          f"{recorded}): delete it, or set another train.output_dir or warm_start.from_run")


def _retriever_stage_config(cfg: RLMConfig, files: DataFiles, out: Path) -> RetrieverTrainConfig:
    """The supervised (Algorithm 1) run that stands in for GTR pre-training."""
    warm = cfg.warm_start
    train = warm.retriever_train or str(Path(files.passages).parent / "retrieval-train.jsonl")
    rcfg = RetrieverTrainConfig(
        data=dataclasses.replace(cfg.data, train=train, dev=[], max_eval_examples=200),
        retriever=cfg.retriever,
        buffer=dataclasses.replace(cfg.buffer, path=None),
        strategy=dataclasses.replace(cfg.strategy, name=warm.retriever_strategy, top_k=8, uniform_negatives=0),
        train=dataclasses.replace(cfg.train, output_dir=str(out), steps=warm.retriever_steps, lr=warm.retriever_lr,
                                  batch_size=warm.retriever_batch_size, eval_every=0, save_every=0, resume=True,
                                  overwrite=False),
    )
    if not rcfg.data.toy or warm.retriever_train:
        rcfg.data.dev = [rcfg.data.train]
    return rcfg


def warm_start_retriever(cfg: RLMConfig, files: DataFiles, run: TrainingRun) -> DualEncoder:
    """The RLM's initial retriever: from config, or from a supervised warm-start run (reused if finished).
    The stage makes no corpus pass: its dev recall is measured by `warm_start_recall`, over the stale buffer."""
    warm = cfg.warm_start
    if warm.retriever_steps == 0:
        return DualEncoder.from_config(cfg.retriever, tokenizer=cfg.retriever.tokenizer or files.tokenizer)
    out = stage_dir(cfg, run, "warm_start_retriever")
    finished, started = (out / "metrics.json").is_file(), (out / STAGE_SETTINGS).is_file()
    run.accelerator.wait_for_everyone()  # every process looks before the stage writes (see the reader stage)
    if finished or started:  # a finished stage, or a killed one that resumes: made with the current settings?
        check_stage(cfg, out, "warm_start_retriever")
    if not finished:
        from rag_train.train.retriever import train_retriever

        rcfg = _retriever_stage_config(cfg, files, out)
        if run.accelerator.is_main_process and not started:  # before training: a finished stage always has them
            out.mkdir(parents=True, exist_ok=True)
            record_stage(cfg, out, "warm_start_retriever")
        train_retriever(rcfg, final_eval=False)
    run.accelerator.wait_for_everyone()
    return DualEncoder.load(out / "retriever")


def warm_start_recall(cfg: RLMConfig, files: DataFiles, run: TrainingRun, retriever: DualEncoder, corpus: Corpus,
                      buffer_dir: Optional[Path]) -> dict:
    """Dev retrieval metrics of the warm-started retriever (printed; the run keeps them in metrics.json). Over
    the stale buffer when the run has one - it IS this retriever's embedding of the corpus, so no second
    pass (stored in buffer.dtype: near-ties may rank differently from fp32) - else over the corpus embedded now."""
    if cfg.warm_start.retriever_steps == 0:
        return {}
    from rag_train.data.sources import dataset_name, resolve_data
    from rag_train.eval.retrieval import evaluate_retrieval, load_eval_set

    out = stage_dir(cfg, run, "warm_start_retriever")
    rcfg = _retriever_stage_config(cfg, files, out)
    dev = resolve_data(rcfg.data, run.accelerator, ["retrieval-train"], ["retrieval-dev"]).dev
    sets = {dataset_name(p): load_eval_set(p, corpus, limit=rcfg.data.max_eval_examples,
                                           empty_answers=rcfg.data.empty_answers) for p in dev}
    retriever.to(run.accelerator.device)
    if buffer_dir is not None:
        metrics = evaluate_retrieval(retriever, corpus, sets, rcfg.eval.recall_at, run.accelerator,
                                     rcfg.eval.batch_size, shard=buffer_local_shard(buffer_dir, run.accelerator))
    else:
        with run.passes.timed("warm-start retriever's dev recall (no stale buffer)", len(corpus)):
            metrics = evaluate_retrieval(retriever, corpus, sets, rcfg.eval.recall_at, run.accelerator,
                                         rcfg.eval.batch_size, embed_workers=cfg.buffer.embed_workers)
    recall = next(iter(metrics.values()), {}).get("recall", {})
    run.accelerator.print(f"warm-start retriever: {out} (dev recall {recall}"
                          f"{', over the stale buffer' if buffer_dir is not None else ''})")
    return metrics


def retrieved_distractors(retriever: DualEncoder, corpus: Corpus, examples: list[QAExample], k: int,
                          run: TrainingRun, buffer_dir: Optional[Path], batch_size: int = 256,
                          embed_workers: int = 0) -> list[list[int]]:
    """Per example, the retriever's top-k rows that are not gold: the passages a reader must learn to tell
    from the gold one (for the toy, people sharing a first or family name with the one asked about). Ranked
    over the stale buffer when there is one (the same retriever's vectors), else over a fresh corpus pass."""
    retriever.to(run.accelerator.device)
    if buffer_dir is not None:
        vectors, offset = buffer_local_shard(buffer_dir, run.accelerator)
    else:
        with run.passes.timed("reader warm start's retrieved distractors (no stale buffer)", len(corpus)):
            vectors, offset = embed_local_shard(retriever, corpus, run.accelerator, batch_size,
                                                num_workers=embed_workers)
    most = max(len(ex.gold_ids) for ex in examples)
    ranked = rank_passages(retriever, vectors, offset, [ex.question for ex in examples],
                           min(k + most, len(corpus)), batch_size).rows
    distractors = []
    for ex, rows in zip(examples, ranked.tolist()):
        gold = set(corpus.rows(ex.gold_ids))
        distractors.append([row for row in rows if row not in gold][:k])
    return distractors


def warm_start_reader(cfg: RLMConfig, reader: torch.nn.Module, tokenizer, corpus: Corpus,
                      train_set: list[QAExample], run: TrainingRun, retriever: DualEncoder,
                      buffer_dir: Optional[Path] = None) -> None:
    """Train the reader for `warm_start.reader_steps` on gold passages + distractors (in place): random
    passages, or the warm-started retriever's top-ranked non-gold ones (`warm_start.reader_distractors`)."""
    steps = cfg.warm_start.reader_steps
    if steps == 0 or run.latest_checkpoint() is not None:
        return
    out = stage_dir(cfg, run, "warm_start_reader")
    finished = out.is_dir()
    # every process looks before any writes: this stage has no collectives, so a late rank could otherwise
    # find the folder the main rank just saved, skip the stage and miss its closing barrier (a hang)
    run.accelerator.wait_for_everyone()
    if finished:
        check_stage(cfg, out, "warm_start_reader")
        hint = f"move {out} aside to train the stage again"
        try:  # a truncated or altered file is named, nothing is loaded
            verify_model_files(out)
        except CorruptFileError as exc:
            raise CorruptFileError(f"the warm-started reader is damaged: {exc}; {hint}") from None
        try:
            saved = type(reader).from_pretrained(out)
        except Exception as exc:  # a stage saved before its files had checksums
            raise CorruptFileError(f"{out}: the warm-started reader cannot be loaded ({type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); {hint}") from None
        reader.load_state_dict(saved.state_dict())
        run.accelerator.print(f"warm-start reader: {out}")
        return
    seed_stage(cfg.train.seed, "warm_start_reader")
    device = run.accelerator.device
    reader.to(device).train()
    # T5's own pre-training optimizer: steps scaled by each weight's RMS. Under AdamW a random-init tiny T5
    # learned to copy several times slower (lr 1e-3) or not at all (2e-3; docs/rlm_toy_log.md).
    optimizer = Adafactor(reader.parameters(), lr=cfg.warm_start.reader_lr, scale_parameter=True,
                          relative_step=False, warmup_init=False)
    scheduler = linear_warmup(optimizer, min(100, steps // 10))
    generator = torch.Generator().manual_seed(cfg.train.seed + 1)
    labelled = [ex for ex in train_set if ex.gold_ids]
    single_hop = [ex for ex in labelled if len(ex.gold_ids) == 1]
    if not labelled or (cfg.warm_start.reader_copy_steps and not single_hop):
        raise ValueError("the reader warm start needs training questions with gold_ids "
                         "(single-hop ones for copy steps)")
    k_many = cfg.warm_start.reader_passages
    hard = None
    if cfg.warm_start.reader_distractors == "retrieved" and steps > cfg.warm_start.reader_copy_steps:
        hard = retrieved_distractors(retriever, corpus, labelled, k_many, run, buffer_dir,  # aligned with `labelled`
                                     embed_workers=cfg.buffer.embed_workers)
    bar = tqdm(range(steps), desc="warm-start reader", disable=not run.accelerator.is_main_process)
    for step in bar:
        copying = step < cfg.warm_start.reader_copy_steps
        pool, k = (single_hop, 1) if copying else (labelled, k_many)
        chosen = global_batch(len(pool), cfg.warm_start.reader_batch_size, cfg.train.seed + 1, step)
        batch = [pool[i] for i in chosen]
        passages = []
        for index, ex in zip(chosen, batch):
            gold = list(corpus.rows(ex.gold_ids[:k]))
            if hard is not None and not copying:
                others = hard[index][: k - len(gold)]
            else:
                others = torch.randint(len(corpus), (k - len(gold),), generator=generator).tolist()
            rows = gold + others
            order = torch.randperm(k, generator=generator).tolist()
            passages.append(corpus.passages([rows[i] for i in order]))
        inputs = fid_inputs(tokenizer, [ex.question for ex in batch], passages, cfg.reader.max_input_length)
        labels = answer_labels(tokenizer, [ex.answers for ex in batch], cfg.reader.max_answer_length, generator)
        loss = reader(**{n: t.to(device) for n, t in inputs.items()}, labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reader.parameters(), cfg.train.max_grad_norm or 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            run.log({"warm_start/reader_loss": loss.item()}, step)
    if run.accelerator.is_main_process:  # written beside, then renamed: a folder here is a finished stage
        with atomic_directory(out, "saving the warm-started reader to", needed=state_bytes(reader) + 2**20) as tmp:
            reader.save_pretrained(tmp)
            record_stage(cfg, tmp, "warm_start_reader", checksums=True)
    run.accelerator.wait_for_everyone()

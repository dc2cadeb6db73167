"""Algorithm 2 of seed 000: a FiD reader and a dense retriever trained together by perplexity distillation,
each question's passages picked from the never-refreshed stale buffer through the corrector.

Per step, for questions x with answers a (`RLMRecipe.train_step`, one method per line):
  1. S_x = top-k of <f(x), h(B[y])> over the whole buffer (or the strategy's other rule)   `select_passages`
  2. P~(y|x)   = softmax over S_x of beta <f(x), g(y)>, g fresh, with gradient             `distillation_loss`
  3. P~_h(y|x) = softmax over S_x of beta <f(x), h(B[y])>                                   `corrector_loss`
  4. P_a(y|x)  = softmax over S_x of log P(a | y, x), from the reader's encoder states      `answer_likelihoods`
  5. reader loss L' = NLL of a given x and all of S_x (FiD)                                 `reader_loss`
  6. retriever loss L = KL(P_a || P~) (perplexity distillation), once the gate is open      `distillation_loss`
  7. corrector loss = CE(P~ || P~_h), which reaches only the corrector                      `corrector_loss`
  8. Theta <- Theta - eta grad (L + L') / 2 ; Psi <- Psi - eta grad (corrector loss)       `optimizer_step`

Reader, retriever and corrector are parts of ONE module (`Trainable`) prepared once with one optimizer, so
the same loop runs on one process, under DDP and under DeepSpeed ZeRO-2 / ZeRO-3: steps 2-7 (everything with a
gradient) are that module's forward (`losses`); retrieval, evaluation and saving follow `train.run`'s rules
for ZeRO. The recipe is a class in torchtune's manner: `setup` (data, warm-started models, then
`setup_training`), `train` (the loop), `save` (final evaluation, models, metrics); `scripts/bench_rlm_step.py`
builds its own models and times this same `train_step`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from rag_train.buffer.embed import buffer_local_shard
from rag_train.data.collate import answer_labels, fid_inputs
from rag_train.data.corpus import Corpus
from rag_train.data.qa import QAExample, load_qa
from rag_train.data.sources import dataset_name, resolve_data
from rag_train.data.tokenizer import load_tokenizer
from rag_train.data.toy import TOY_DEV_SETS, TOY_TRAIN_SETS
from rag_train.eval.metrics import has_answer
from rag_train.eval.qa import EMPTY_PASSAGE, QAEvalSettings, evaluate_qa
from rag_train.io import atomic_write_text
from rag_train.losses import perplexity_distillation, retrieval_scores
from rag_train.models.reader import FiDReader
from rag_train.strategies import StrategyContext, build_strategy, strategy_class
from rag_train.train.gate import RetrieverGate
from rag_train.train.passages import ensure_buffer, ensure_token_cache
from rag_train.train.run import (
    TrainingRun,
    flat_metrics,
    releases_on_input_fault,
    save_pretrained_atomic,
    steps_per_second,
)
from rag_train.train.schema import RLMConfig
from rag_train.train.step import global_batch, linear_warmup, local_slice, optimizer_step, seed_stage
from rag_train.train.trainable import Trainable, full_weights, save_parts
from rag_train.train.warm_start import warm_start_reader, warm_start_recall, warm_start_retriever


def answer_choice(batch: list, seed: int, step: int, accelerator) -> list[int]:
    """Which gold answer each question trains on at `step`: drawn for the global batch from (seed, step),
    so resuming and the number of processes do not change it."""
    draws = np.random.default_rng([seed, step, 17]).random(len(batch) * accelerator.num_processes)
    mine = local_slice(draws, accelerator)
    return [int(u * len(ex.answers)) for u, ex in zip(mine, batch)]


def global_token_mean(logits: torch.Tensor, labels: torch.Tensor, accelerator) -> torch.Tensor:
    """Answer NLL averaged over the answer tokens of the GLOBAL batch. The local sum is scaled so that DDP's
    gradient average gives exactly the global token mean, whatever the token count on each process."""
    token_sum = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                                  reduction="sum")
    tokens = accelerator.reduce((labels != -100).sum().float(), "sum")
    return token_sum * accelerator.num_processes / tokens.clamp_min(1)


@dataclass
class StepBatch:
    """This process's questions of one step after step 1: what the reader reads and the losses need."""

    questions: list[str]
    labels: torch.Tensor  # [B, T] the answer each question trains on (`answer_choice`), -100 padded
    passages: list[list[dict]]  # S_x as passages, k per question ([EMPTY_PASSAGE] when closed book)
    inputs: dict[str, torch.Tensor]  # FiD input_ids / attention_mask [B, k, L]
    rows: Optional[torch.Tensor] = None  # [B, k] S_x as corpus rows (None: nothing retrieved)
    deeper: Optional[torch.Tensor] = None  # [B, c - k] the corrector's further candidates (its loss only)
    contains: Optional[torch.Tensor] = None  # [B, k] the passage contains one of the question's answers


class RLMRecipe:
    """Algorithm 2 as a torchtune-style recipe: `setup()`, `train()`, `save()`; `train_step` is one step."""

    def __init__(self, cfg: RLMConfig):
        self.cfg = cfg
        # find_unused_parameters: the retriever has no gradient before its gate opens
        self.run = TrainingRun(cfg, "rlm", find_unused_parameters=True)
        self.accelerator = self.run.accelerator
        self.step = 0
        self.history = self.run.history  # restored by run.resume(), checkpointed by run.save()
        self.warm_recall: dict = {}  # the warm-started retriever's dev metrics (`warm_start_recall`)

    # -- setup -----------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Data, the warm-started reader and retriever (stand-ins for pre-training), the rest of the training
        state (`setup_training`), then the latest checkpoint when resuming."""
        cfg, acc = self.cfg, self.accelerator
        files = resolve_data(cfg.data, acc, TOY_TRAIN_SETS, TOY_DEV_SETS,
                             {"retriever.model": cfg.retriever.model, "reader.model": cfg.reader.model})
        corpus = Corpus.open(files.passages)
        self.run.check_corpus(corpus)  # k <= corpus size, same corpus on every process: before any long work
        policy = cfg.data.empty_answers
        self.train_set = [ex for path in files.train for ex in load_qa(path, corpus=corpus, empty_answers=policy)
                          ][: cfg.data.max_train_examples]
        self.dev_sets = {dataset_name(p): load_qa(p, corpus=corpus, limit=cfg.data.max_eval_examples,
                                                  empty_answers=policy) for p in files.dev}
        tokenizer = load_tokenizer(cfg.reader.tokenizer or files.tokenizer)

        # The stale buffer is the warm-started retriever's embedding of the corpus: built once, it also gives that
        # retriever's dev recall (and the reader's retrieved distractors) without another corpus pass.
        retriever = warm_start_retriever(cfg, files, self.run)
        if strategy_class(cfg.strategy.name).retrieves:  # a closed-book run makes no corpus pass
            ensure_token_cache(self.run, cfg.buffer, retriever, corpus)
        needs_buffer = strategy_class(cfg.strategy.name).needs_buffer
        buffer_dir = ensure_buffer(self.run, cfg.buffer, retriever, corpus) if needs_buffer else None
        self.warm_recall = warm_start_recall(cfg, files, self.run, retriever, corpus, buffer_dir)
        # Every stage draws from its own seed (seed_stage): a stage reused from disk after a kill leaves the next one
        # exactly where a straight run would.
        seed_stage(cfg.train.seed, "reader_init")
        reader = FiDReader.from_config(cfg.reader, tokenizer)
        warm_start_reader(cfg, reader, tokenizer, corpus, self.train_set, self.run, retriever, buffer_dir)
        self.setup_training(reader, retriever, tokenizer, corpus, buffer_dir)
        self.step = self.run.resume()
        if self.step:
            self.strategy.load(self.run.latest_checkpoint())

    def setup_training(self, reader: FiDReader, retriever, tokenizer, corpus: Corpus,
                       buffer_dir: Optional[Path] = None) -> None:
        """The strategy (and its stale buffer `buffer_dir`, else built from `retriever` as it is now), one AdamW over
        everything trained, the prepared module and the gate. Everything trained is one module with one optimizer
        (DeepSpeed: one engine); the parameter groups keep their own learning rates."""
        cfg, acc = self.cfg, self.accelerator
        self.tokenizer, self.corpus = tokenizer, corpus
        if buffer_dir is None and strategy_class(cfg.strategy.name).needs_buffer:
            buffer_dir = ensure_buffer(self.run, cfg.buffer, retriever, corpus)
        self.buffer_dir = buffer_dir
        seed_stage(cfg.train.seed, "rlm")  # the corrector's initial weights, then training (a resume restores the RNG)
        ctx = StrategyContext(acc, retriever, corpus, cfg.buffer, buffer_dir, cfg.train.temperature, cfg.train.seed)
        self.strategy = strategy = build_strategy(cfg.strategy, ctx)
        self.run.guard.aux_max_loss = strategy.auxiliary_max_loss

        groups = [{"params": list(reader.parameters()), "lr": cfg.train.lr, "weight_decay": cfg.train.weight_decay}]
        if strategy.trains_retriever:
            groups.append({"params": [p for p in retriever.parameters() if p.requires_grad],
                           "lr": cfg.retriever_lr if cfg.retriever_lr is not None else cfg.train.lr,
                           "weight_decay": cfg.train.weight_decay})
        else:
            retriever.requires_grad_(False)
        groups += strategy.param_groups()
        optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr)
        scheduler = linear_warmup(optimizer, cfg.train.warmup_steps)
        self.model, self.optimizer, self.scheduler = self.run.prepare(
            Trainable(reader=reader, retriever=retriever, **strategy.modules()), optimizer, scheduler)
        parts = acc.unwrap_model(self.model)
        # the same modules, now on the device (and partitioned under ZeRO-3)
        self.reader, self.retriever = parts.reader, parts.retriever
        ctx.gather = lambda *modules: full_weights(acc, self.model, *modules)
        self.trained = [p for g in groups for p in g["params"]]
        self.gate = RetrieverGate(cfg, strategy.trains_retriever, acc)
        acc.register_for_checkpointing(self.gate)  # a resumed run keeps when the gate opened
        self.eval_settings = QAEvalSettings.from_config(cfg, closed_book=not strategy.retrieves)

    # -- one step of Algorithm 2 -----------------------------------------------------------------------

    def train_step(self, examples: list[QAExample], step: int) -> dict:
        """Steps 1-8 for this process's questions at global step `step`; returns the values to log."""
        batch = self.select_passages(examples, step)  # 1.
        out = self.model(self.losses, batch, step)  # 2.-7., in one forward of the prepared module
        # 8. one optimizer step for reader, retriever and corrector (their losses are disjoint)
        optimizer_step(self.accelerator, out["loss"], self.trained, self.optimizer, self.scheduler, self.run.guard,
                       self.cfg.train.max_grad_norm, aux=out["aux"])
        return out["logged"]

    def select_passages(self, examples: list[QAExample], step: int) -> StepBatch:
        """1. S_x: the strategy's top-k for each question (queries without gradient, eval mode), as FiD inputs,
        with the answer each question trains on at this step."""
        cfg, acc, retriever = self.cfg, self.accelerator, self.retriever
        questions = [ex.question for ex in examples]
        answers = [ex.answers[i] for ex, i in zip(examples, answer_choice(examples, cfg.train.seed, step, acc))]
        labels = answer_labels(self.tokenizer, answers, cfg.reader.max_answer_length).to(acc.device)
        rows = contains = deeper = None
        if self.strategy.retrieves:
            with torch.no_grad():
                retriever.eval()
                ranked = self.strategy.retrieve(retriever.encode_queries(questions).float(),
                                                self.strategy.search_depth(cfg.strategy.top_k))
                retriever.train()
            rows, deeper = ranked[:, : cfg.strategy.top_k], ranked[:, cfg.strategy.top_k:]
            passages = [self.corpus.passages(r) for r in rows.tolist()]
            contains = torch.tensor([[has_answer(p["text"], ex.answers) for p in ps]
                                     for ex, ps in zip(examples, passages)])
        else:
            passages = [[EMPTY_PASSAGE] for _ in examples]
        inputs = fid_inputs(self.tokenizer, questions, passages, cfg.reader.max_input_length)
        inputs = {name: tensor.to(acc.device) for name, tensor in inputs.items()}
        return StepBatch(questions, labels, passages, inputs, rows, deeper, contains)

    def losses(self, parts: Trainable, batch: StepBatch, step: int) -> dict:
        """Steps 2-7, everything with a gradient: run as the prepared module's forward (`parts` is its
        unwrapped self). The retriever's loss joins once the gate opens; the corrector's only reaches it."""
        reader_loss, encoder_states = self.reader_loss(parts.reader, batch)  # 5.
        logged = {"reader_loss": reader_loss.item()}
        result = {"loss": reader_loss, "aux": None, "logged": logged}
        if batch.rows is None:  # closed book: no passages, nothing to distil
            return result
        loglik = self.answer_likelihoods(parts.reader, batch, encoder_states)  # 4.
        if self.gate.update(step, loglik, batch.contains):
            queries, passage_vectors, retriever_loss = self.distillation_loss(parts.retriever, batch, loglik)  # 2., 6.
            result["loss"] = (retriever_loss + reader_loss) / 2
            logged["retriever_loss"] = retriever_loss.item()
            logged["embedding_spread"] = self.gate.check_collapse(step, passage_vectors)
            aux = self.corrector_loss(parts.retriever, batch, queries, passage_vectors)  # 3., 7.
            if aux is not None:
                logged["corrector_loss"] = aux.item()
            result["aux"] = aux
        logged["p_a_answer_lift"] = self.gate.lift
        return result

    def reader_loss(self, reader: FiDReader, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """5. L' = NLL of the answer given x and all of S_x (FiD), a mean over the global batch's answer tokens;
        also the encoder states, which step 4 reuses."""
        out = reader(**batch.inputs, labels=batch.labels)
        return global_token_mean(out.logits, batch.labels, self.accelerator), out.encoder_last_hidden_state

    def answer_likelihoods(self, reader: FiDReader, batch: StepBatch, encoder_states: torch.Tensor) -> torch.Tensor:
        """4. log P(a | y, x) [B, k] for each passage alone, from the FiD encoder states (no re-encoding): the
        distillation target, so no gradient, and full precision under mixed-precision autocast too."""
        with torch.no_grad(), torch.autocast(self.accelerator.device.type, enabled=False):
            return reader.passage_log_likelihoods(batch.inputs["input_ids"], batch.inputs["attention_mask"],
                                                  batch.labels, encoder_states=encoder_states)

    def distillation_loss(self, retriever, batch: StepBatch, loglik: torch.Tensor) -> tuple:
        """2. P~ from fresh f(x), g(y) over S_x, with gradient; 6. L = KL(P_a || P~), perplexity distillation.
        Returns the query vectors, the passage vectors [B, k, d] and L."""
        cfg = self.cfg
        queries, passage_vectors = retriever(batch.questions, [p for ps in batch.passages for p in ps])
        passage_vectors = passage_vectors.view(len(batch.questions), cfg.strategy.top_k, -1)
        scores = retrieval_scores(queries, passage_vectors)
        return queries, passage_vectors, perplexity_distillation(scores, loglik, cfg.train.temperature,
                                                                 cfg.reader_temperature)

    def corrector_loss(self, retriever, batch: StepBatch, queries: torch.Tensor,
                       passage_vectors: torch.Tensor) -> Optional[torch.Tensor]:
        """3. P~_h over the same passages (and the rest of the corrector's top-`candidates`, embedded fresh
        without gradient); 7. the strategy's auxiliary loss CE(P~ || P~_h), from detached inputs: it only
        reaches the corrector. None for strategies without one."""
        rows, deeper = batch.rows, batch.deeper
        aux_rows, aux_vectors = rows, passage_vectors.detach()
        if deeper is not None and deeper.shape[1]:
            with torch.no_grad():
                more = retriever.encode_passages([p for r in deeper.tolist() for p in self.corpus.passages(r)])
            aux_rows = torch.cat([rows, deeper], dim=1)
            more = more.view(len(batch.questions), deeper.shape[1], -1).to(aux_vectors)
            aux_vectors = torch.cat([aux_vectors, more], 1)
        return self.strategy.auxiliary_loss(queries.detach(), aux_rows, aux_vectors,
                                            retrieval_scores(queries.detach(), aux_vectors))

    # -- the loop, evaluation, saving ------------------------------------------------------------------

    def train(self) -> None:
        """Steps until `train.steps`, with evaluations (curves start at step 0, the warm-started models) and
        checkpoints; the training steps' own seconds are kept for steps/s."""
        cfg, acc, guard = self.cfg, self.accelerator, self.run.guard
        if cfg.train.eval_every and self.step == 0:
            self.record_eval()
        first_step, started, eval_seconds = self.step, time.time(), 0.0
        bar = tqdm(total=cfg.train.steps, initial=self.step, desc=f"rlm[{cfg.strategy.name}]",
                   disable=not acc.is_main_process)
        while self.step < cfg.train.steps:
            order = global_batch(len(self.train_set), cfg.train.batch_size, cfg.train.seed, self.step)
            logged = self.train_step([self.train_set[i] for i in local_slice(order, acc)], self.step)
            self.step += 1
            self.strategy.after_step(self.step)
            bar.update(1)
            step = self.step
            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                strategy_values = self.strategy.logged_values()
                self.run.record_strategy_values(step, strategy_values)
                self.run.log({**logged, **strategy_values, "embedded": self.strategy.embedded,
                              "skipped_steps": guard.skipped}, step)
                bar.set_postfix(reader=f"{logged['reader_loss']:.3f}", gate=int(self.gate.open))
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                eval_seconds += self.record_eval()
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < cfg.train.steps:
                self.run.save(step, extra=self.strategy.save)
            self.run.stop_if_signalled(step, extra=self.strategy.save)
        bar.close()
        # training steps only: evaluations left out
        self.steps_per_second = steps_per_second(first_step, self.step, time.time() - started - eval_seconds)

    def evaluate(self, final: bool) -> tuple[dict, dict]:
        """Every process ranks over its share of the corpus and generates for all questions: not in lockstep.
        Exact (the corpus embedded now) at the end, and during training up to `eval.fresh_rows` rows; beyond
        that over the stale buffer (no corpus pass) when the run has one. Each set's ranking also lands in
        `<run>/eval/step-<step>/<set>.trec`."""
        acc, corpus, settings = self.accelerator, self.corpus, self.eval_settings
        over_buffer = not final and self.buffer_dir is not None and len(corpus) > self.cfg.eval.fresh_rows
        out_dir = self.run.dir / "eval" / f"step-{self.step}"
        args = (self.retriever, self.reader, self.tokenizer, corpus, self.dev_sets, settings, acc)
        with full_weights(acc, self.model, self.reader, self.retriever):
            if over_buffer or settings.closed_book:
                shard = buffer_local_shard(self.buffer_dir, acc) if over_buffer else None
                return evaluate_qa(*args, out_dir=out_dir, shard=shard)
            with self.run.passes.timed("final evaluation" if final else f"evaluation at step {self.step}", len(corpus)):
                return evaluate_qa(*args, out_dir=out_dir)

    def record_eval(self) -> float:
        """Evaluate into `history`; returns its seconds."""
        eval_started = time.time()
        metrics, _ = self.evaluate(final=False)
        self.history.append({"step": self.step, **metrics})
        self.run.log(flat_metrics(metrics), self.step)
        return time.time() - eval_started

    def save(self) -> dict:
        """The last checkpoint, the final evaluation, the trained reader and retriever, the dev predictions and
        metrics.json (returned)."""
        run, acc, step = self.run, self.accelerator, self.step
        run.save(step, extra=self.strategy.save)
        metrics, predictions = self.evaluate(final=True)
        self.history.append({"step": step, **metrics})
        save_parts(acc, self.model, {"retriever": lambda m: m.save(run.dir / "retriever"),
                                     "reader": lambda m: save_pretrained_atomic(run.dir / "reader", m, self.tokenizer)})
        if acc.is_main_process:
            write_predictions(run.dir / "predictions", predictions)
        k = self.eval_settings.num_passages
        result = {
            "em": {name: m["em"] for name, m in metrics.items()},
            f"answer_recall@{k}": {name: m.get(f"answer_recall@{k}") for name, m in metrics.items()},
            "reembedded_passages": self.strategy.embedded,
            "skipped_steps": run.guard.skipped,
            "retriever_trained_from_step": self.gate.opened_at,
            "collapsed_at_step": self.gate.collapsed_at,
            "steps": step,
            "steps_per_second": self.steps_per_second,
            "strategy": self.cfg.strategy.name,
            "history": self.history,
            "warm_start_retriever": self.warm_recall,
            "strategy_summary": self.strategy.summary(),  # the strategy's own values (the refresh steps, ...)
            # per logged step (train.log_every): the strategy's own values, e.g. the corrector's drift on its subset
            "strategy_log": self.run.strategy_log(),
        }
        run.write_metrics(result)
        run.end()
        return result


@releases_on_input_fault
def train_rlm(cfg: RLMConfig) -> dict:
    """Run the recipe end to end; returns what metrics.json holds."""
    recipe = RLMRecipe(cfg)
    recipe.setup()
    recipe.train()
    return recipe.save()


def write_predictions(directory: Path, predictions: dict[str, list[dict]]) -> None:
    for name, rows in predictions.items():
        atomic_write_text(directory / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))

"""Algorithm 2 of seed 000: a FiD reader and a dense retriever trained together by perplexity distillation,
each question's passages picked from the never-refreshed stale buffer through the corrector.

Per step, for questions x with answers a:
  1. S_x = top-k of <f(x), h(B[y])> over the whole buffer (or the strategy's other rule);
  2. P~(y|x)   = softmax over S_x of beta <f(x), g(y)>, g fresh, with gradient;
  3. P~_h(y|x) = softmax over S_x of beta <f(x), h(B[y])>          (inside the strategy's auxiliary loss);
  4. P_a(y|x)  = softmax over S_x of log P(a | y, x), from the reader's encoder states, no gradient;
  5. reader loss L' = NLL of a given x and all of S_x (FiD);
  6. retriever loss L = KL(P_a || P~) (perplexity distillation);
  7. corrector loss = CE(P~ || P~_h), which reaches only the corrector;
  8. Theta <- Theta - eta grad (L + L') / 2 ; Psi <- Psi - eta grad (corrector loss).

Reader, retriever and corrector are parts of ONE module (`Trainable`) prepared once with one optimizer, so
the same loop runs on one process, under DDP and under DeepSpeed ZeRO-2 / ZeRO-3: steps 2-7 (everything with a
gradient) are that module's forward; retrieval, evaluation and saving follow `train.common`'s rules for ZeRO.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from rag_train.data.collate import answer_labels, fid_inputs
from rag_train.data.corpus import Corpus
from rag_train.data.qa import load_qa
from rag_train.data.sources import dataset_name, resolve_data
from rag_train.data.toy import TOY_DEV_SETS, TOY_TRAIN_SETS
from rag_train.eval.metrics import has_answer
from rag_train.eval.qa import EMPTY_PASSAGE, QAEvalSettings, evaluate_qa
from rag_train.io import atomic_write_text
from rag_train.losses import perplexity_distillation, retrieval_scores
from rag_train.models.reader import FiDReader
from rag_train.data.tokenizer import load_tokenizer
from rag_train.strategies import REGISTRY, StrategyContext, build_strategy
from rag_train.train.schema import RLMConfig
from rag_train.train.common import (TrainingRun, global_batch, linear_warmup, local_slice, optimizer_step,
                                    save_pretrained_atomic)
from rag_train.train.trainable import Trainable, full_weights, save_parts
from rag_train.train.passages import ensure_buffer
from rag_train.train.warm_start import warm_start_reader, warm_start_retriever


class RetrieverGate:
    """Retriever updates start once the reader's P_a prefers the passages that contain an answer (running
    mean of its mass there, above the share of such passages, exceeds `pdist_gate`, after
    `retriever_start_step`), and stop for good if the passage embeddings collapse."""

    def __init__(self, cfg: RLMConfig, enabled: bool, accelerator):
        self.cfg = cfg
        self.enabled = enabled
        self.accelerator = accelerator  # decisions use values averaged over processes: DDP needs them equal
        self.lift = 0.0
        self.opened_at = None
        self.collapsed_at = None

    @property
    def open(self) -> bool:
        return self.opened_at is not None and self.collapsed_at is None

    def update(self, step: int, reader_loglik: torch.Tensor, has_answer: torch.Tensor) -> bool:
        """`has_answer` [B, k]: passage k contains one of question b's answers (DPR `has_answer`)."""
        if not self.enabled or self.collapsed_at is not None:
            return False
        p_a = torch.softmax(reader_loglik.float() / self.cfg.reader_temperature, dim=-1)
        hits = has_answer.to(p_a.device).float()
        mixed = (hits.sum(-1) > 0) & (hits.sum(-1) < hits.shape[-1])  # only there can P_a discriminate
        lift = ((p_a * hits).sum(-1) - hits.mean(-1))[mixed].sum()
        totals = self.accelerator.reduce(torch.stack([lift, mixed.sum().float()]), "sum")
        if totals[1] > 0:
            self.lift = 0.9 * self.lift + 0.1 * (totals[0] / totals[1]).item()
        discriminates = self.cfg.pdist_gate == 0 or self.lift > self.cfg.pdist_gate  # 0: no gate
        if self.opened_at is None and step >= self.cfg.retriever_start_step and discriminates:
            self.opened_at = step
        return self.open

    def check_collapse(self, step: int, passages: torch.Tensor) -> float:
        """1 - mean pairwise cosine of the step's passage vectors (0 = all the same vector)."""
        unit = torch.nn.functional.normalize(passages.detach().float().reshape(-1, passages.shape[-1]), dim=-1)
        n = unit.shape[0]
        spread = 1.0 - (unit.sum(0).pow(2).sum() - n) / max(1, n * (n - 1))
        spread = self.accelerator.reduce(spread, "mean").item()
        if spread < self.cfg.min_embedding_spread and self.collapsed_at is None:
            self.collapsed_at = step
            self.accelerator.print(f"warning: retriever embeddings collapsed at step {step} (spread {spread:.4f} < "
                                   f"min_embedding_spread={self.cfg.min_embedding_spread}); retriever updates stop")
        return spread


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


def train_rlm(cfg: RLMConfig) -> dict:
    run = TrainingRun(cfg, "rlm", find_unused_parameters=True)  # the retriever has no gradient before its gate opens
    acc = run.accelerator
    files = resolve_data(cfg.data, acc, TOY_TRAIN_SETS, TOY_DEV_SETS)
    corpus = Corpus.open(files.passages)
    run.check_corpus(corpus)  # k <= corpus size, same corpus on every process: before any long work
    train_set = [ex for path in files.train for ex in load_qa(path, corpus=corpus)][: cfg.data.max_train_examples]
    dev_sets = {dataset_name(p): load_qa(p, corpus=corpus, limit=cfg.data.max_eval_examples) for p in files.dev}
    tokenizer = load_tokenizer(cfg.reader.tokenizer or files.tokenizer)

    # Stand-ins for pre-training (toy default): a retriever that can retrieve, a reader that can read.
    retriever = warm_start_retriever(cfg, files, run)
    reader = FiDReader.from_config(cfg.reader, tokenizer)
    warm_start_reader(cfg, reader, tokenizer, corpus, train_set, run, retriever)

    strategy_cls = REGISTRY[cfg.strategy.name]
    buffer_dir = ensure_buffer(run, cfg.buffer, retriever, corpus) if strategy_cls.needs_buffer else None
    ctx = StrategyContext(acc, retriever, corpus, cfg.buffer, buffer_dir, cfg.train.temperature, cfg.train.seed)
    strategy = build_strategy(cfg.strategy, ctx)
    run.guard.aux_max_loss = strategy.auxiliary_max_loss
    trains_retriever = strategy.trains_retriever

    # Everything trained is one module with one optimizer (DeepSpeed: one engine); groups keep their own lrs.
    groups = [{"params": list(reader.parameters()), "lr": cfg.train.lr, "weight_decay": cfg.train.weight_decay}]
    if trains_retriever:
        groups.append({"params": [p for p in retriever.parameters() if p.requires_grad],
                       "lr": cfg.retriever_lr if cfg.retriever_lr is not None else cfg.train.lr,
                       "weight_decay": cfg.train.weight_decay})
    else:
        retriever.requires_grad_(False)
    groups += strategy.param_groups()
    optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr)
    scheduler = linear_warmup(optimizer, cfg.train.warmup_steps)
    model, optimizer, scheduler = run.prepare(Trainable(reader=reader, retriever=retriever, **strategy.modules()),
                                              optimizer, scheduler)
    parts = acc.unwrap_model(model)
    reader, retriever = parts.reader, parts.retriever  # the same modules, now on the device (and partitioned under ZeRO-3)
    ctx.gather = lambda *modules: full_weights(acc, model, *modules)
    trained = [p for g in groups for p in g["params"]]
    guard = run.guard
    gate = RetrieverGate(cfg, trains_retriever, acc)
    step = run.resume()
    if step:
        strategy.load(run.latest_checkpoint())

    settings = QAEvalSettings(cfg.eval.num_passages or cfg.strategy.top_k, cfg.reader.max_input_length,
                              cfg.reader.max_answer_length, cfg.eval.batch_size, closed_book=not strategy.retrieves)
    history = []

    def evaluate() -> tuple[dict, dict]:
        """Every process embeds its share of the corpus and generates for all questions: not in lockstep.
        Each set's ranking also lands in `<run>/eval/step-<step>/<set>.trec`."""
        with full_weights(acc, model, reader, retriever):
            return evaluate_qa(retriever, reader, tokenizer, corpus, dev_sets, settings, acc,
                               out_dir=run.dir / "eval" / f"step-{step}")

    def record_eval() -> float:
        """Evaluate into `history` (curves start at step 0, the warm-started models); returns its seconds."""
        eval_started = time.time()
        metrics, _ = evaluate()
        history.append({"step": step, **metrics})
        run.log({f"eval/{n}/{k}": v for n, m in metrics.items() for k, v in m.items()}, step)
        return time.time() - eval_started

    def losses(parts: Trainable, inputs: dict, labels: torch.Tensor, questions: list[str], passages: list[list[dict]],
               rows: torch.Tensor | None, contains: torch.Tensor | None, deeper: torch.Tensor | None) -> dict:
        """Steps 2-7: everything with a gradient, run as the prepared module's forward."""
        # 5. reader loss L' = NLL of a given x and S_x (FiD); 4. P(a | y, x) from the same encoder states
        out = parts.reader(**inputs, labels=labels)
        reader_loss = global_token_mean(out.logits, labels, acc)
        result = {"loss": reader_loss, "aux": None, "logged": {"reader_loss": reader_loss.item()}}
        if rows is None:
            return result
        logged = result["logged"]
        # a distillation target, no gradient; full precision under mixed-precision autocast too
        with torch.no_grad(), torch.autocast(acc.device.type, enabled=False):
            loglik = parts.reader.passage_log_likelihoods(inputs["input_ids"], inputs["attention_mask"], labels,
                                                          encoder_states=out.encoder_last_hidden_state)
        # 2./6. P~ from fresh f(x), g(y) and perplexity distillation, once the reader discriminates
        if gate.update(step, loglik, contains):
            queries, passage_vectors = parts.retriever(questions, [p for ps in passages for p in ps])
            passage_vectors = passage_vectors.view(len(questions), cfg.strategy.top_k, -1)
            scores = retrieval_scores(queries, passage_vectors)
            retriever_loss = perplexity_distillation(scores, loglik, cfg.train.temperature, cfg.reader_temperature)
            result["loss"] = (retriever_loss + reader_loss) / 2
            logged["retriever_loss"] = retriever_loss.item()
            logged["embedding_spread"] = gate.check_collapse(step, passage_vectors)
            # 7. corrector loss on the same passages (and on the rest of its top-`candidates`, embedded fresh),
            #    detached inputs: it only reaches the corrector
            aux_rows, aux_vectors = rows, passage_vectors.detach()
            if deeper is not None and deeper.shape[1]:
                with torch.no_grad():
                    more = parts.retriever.encode_passages([p for r in deeper.tolist() for p in corpus.passages(r)])
                aux_rows = torch.cat([rows, deeper], dim=1)
                aux_vectors = torch.cat([aux_vectors, more.view(len(questions), deeper.shape[1], -1).to(aux_vectors)], 1)
            aux = strategy.auxiliary_loss(queries.detach(), aux_rows, aux_vectors,
                                          retrieval_scores(queries.detach(), aux_vectors))
            if aux is not None:
                logged["corrector_loss"] = aux.item()
            result["aux"] = aux
        logged["p_a_answer_lift"] = gate.lift
        return result

    if cfg.train.eval_every and step == 0:
        record_eval()
    first_step, started, eval_seconds = step, time.time(), 0.0
    bar = tqdm(total=cfg.train.steps, initial=step, desc=f"rlm[{cfg.strategy.name}]", disable=not acc.is_main_process)
    while step < cfg.train.steps:
        batch = [train_set[i] for i in local_slice(global_batch(len(train_set), cfg.train.batch_size, cfg.train.seed, step), acc)]
        questions = [ex.question for ex in batch]
        answers = [ex.answers[i] for ex, i in zip(batch, answer_choice(batch, cfg.train.seed, step, acc))]
        labels = answer_labels(tokenizer, answers, cfg.reader.max_answer_length).to(acc.device)

        # 1. S_x: the strategy's top-k for each question (queries without gradient, eval mode)
        rows = contains = deeper = None
        if strategy.retrieves:
            with torch.no_grad():
                retriever.eval()
                ranked = strategy.retrieve(retriever.encode_queries(questions).float(),
                                           strategy.search_depth(cfg.strategy.top_k))
                retriever.train()
            rows, deeper = ranked[:, : cfg.strategy.top_k], ranked[:, cfg.strategy.top_k:]
            passages = [corpus.passages(r) for r in rows.tolist()]
            contains = torch.tensor([[has_answer(p["text"], ex.answers) for p in ps] for ex, ps in zip(batch, passages)])
        else:
            passages = [[EMPTY_PASSAGE] for _ in batch]
        inputs = fid_inputs(tokenizer, questions, passages, cfg.reader.max_input_length)
        inputs = {name: tensor.to(acc.device) for name, tensor in inputs.items()}

        # 2.-7. the losses, in one forward of the prepared module
        out = model(losses, inputs, labels, questions, passages, rows, contains, deeper)
        logged = out["logged"]

        # 8. one optimizer step for reader, retriever and corrector (their losses are disjoint)
        optimizer_step(acc, out["loss"], trained, optimizer, scheduler, guard, cfg.train.max_grad_norm, aux=out["aux"])
        step += 1
        strategy.after_step(step)
        bar.update(1)

        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            run.log({**logged, "embedded": strategy.embedded, "skipped_steps": guard.skipped}, step)
            bar.set_postfix(reader=f"{logged['reader_loss']:.3f}", gate=int(gate.open))
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
            eval_seconds += record_eval()
        if cfg.train.save_every and step % cfg.train.save_every == 0 and step < cfg.train.steps:
            run.save(step, extra=strategy.save)
    bar.close()
    train_seconds = time.time() - started - eval_seconds  # training steps only: evaluations left out

    run.save(step, extra=strategy.save)
    metrics, predictions = evaluate()
    history.append({"step": step, **metrics})
    save_parts(acc, model, {"retriever": lambda m: m.save(run.dir / "retriever"),
                            "reader": lambda m: save_pretrained_atomic(run.dir / "reader", m, tokenizer)})
    if acc.is_main_process:
        write_predictions(run.dir / "predictions", predictions)
    result = {
        "em": {name: m["em"] for name, m in metrics.items()},
        f"answer_recall@{settings.num_passages}": {name: m.get(f"answer_recall@{settings.num_passages}") for name, m in metrics.items()},
        "reembedded_passages": strategy.embedded,
        "skipped_steps": guard.skipped,
        "retriever_trained_from_step": gate.opened_at,
        "collapsed_at_step": gate.collapsed_at,
        "steps": step,
        "steps_per_second": (step - first_step) / train_seconds if step > first_step else None,
        "strategy": cfg.strategy.name,
        "history": history,
    }
    run.write_metrics(result)
    run.end()
    return result


def write_predictions(directory: Path, predictions: dict[str, list[dict]]) -> None:
    import json

    for name, rows in predictions.items():
        atomic_write_text(directory / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))

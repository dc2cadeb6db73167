"""Algorithm 1 of seed 000: supervised dense retrieval with a truncated softmax over a shared subset.

Per step, for a batch of (question x_i, positive y_i):
  1. S = union over the global batch of the strategy's top-k for each x_i (stale buffer, corrector-scored
     buffer, refreshed buffer, cache, ...) + uniform targets + every positive;
  2. fresh f(x_i) and g(y) for y in S, with gradient (each process encodes 1/N of S, gathered with grad);
  3. task loss = cross-entropy of softmax(beta <f(x_i), g(y)>) over S against y_i (the strategy may replace
     it, e.g. the negative cache's surrogate); auxiliary loss (the corrector's) on the same subset;
  4. one optimizer step; then the strategy updates its own state (refresh, FIFO, ...).

The retriever and the strategy's corrector are parts of ONE prepared module (`Trainable`, one optimizer) whose
forward is steps 2-3, as in the RLM recipe: the same loop runs on one process, under DDP and DeepSpeed ZeRO.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from rag_train.config import RetrieverTrainConfig
from rag_train.data.corpus import Corpus
from rag_train.data.sources import dataset_name, resolve_data
from rag_train.data.supervised import load_retrieval
from rag_train.eval.retrieval import evaluate_retrieval, load_eval_set
from rag_train.models.retriever import DualEncoder
from rag_train.losses import retrieval_scores
from rag_train.strategies import REGISTRY, StrategyContext, Subset, build_strategy
from rag_train.train.common import TrainingRun, global_batch, linear_warmup, local_slice, optimizer_step
from rag_train.train.trainable import Trainable, full_weights, save_parts
from rag_train.train.stages import ensure_buffer, gather_with_grad, my_share


def train_retriever(cfg: RetrieverTrainConfig) -> dict:
    run = TrainingRun(cfg, "retriever")
    acc = run.accelerator
    files = resolve_data(cfg.data, acc, ["retrieval-train"], ["retrieval-dev"])
    corpus = Corpus.open(files.passages)
    run.check_corpus(corpus)  # k <= corpus size, same corpus on every process: before any long work
    train_set = [ex for path in files.train for ex in load_retrieval(path, corpus=corpus)][: cfg.data.max_train_examples]
    dev_sets = {dataset_name(p): load_eval_set(p, corpus, limit=cfg.data.max_eval_examples) for p in files.dev}

    model = DualEncoder.from_config(cfg.retriever, tokenizer=cfg.retriever.tokenizer or files.tokenizer)
    buffer_dir = ensure_buffer(run, cfg.buffer, model, corpus) if REGISTRY[cfg.strategy.name].needs_buffer else None
    ctx = StrategyContext(acc, model, corpus, cfg.buffer, buffer_dir, cfg.train.temperature, cfg.train.seed)
    strategy = build_strategy(cfg.strategy, ctx)

    params = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.train.lr,
               "weight_decay": cfg.train.weight_decay}] + strategy.param_groups()
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr)
    scheduler = linear_warmup(optimizer, cfg.train.warmup_steps)
    trainable, optimizer, scheduler = run.prepare(Trainable(retriever=model, **strategy.modules()), optimizer, scheduler)
    model = ctx.model = acc.unwrap_model(trainable).retriever  # the same module, on the device
    ctx.gather = lambda *modules: full_weights(acc, trainable, *modules)
    guard = run.guard
    step = run.resume()
    if step:
        strategy.load(run.latest_checkpoint())

    history = []

    def evaluate() -> dict:
        """Metrics per dev set; each set's ranking also lands in `<run>/eval/step-<step>/<set>.trec`."""
        with full_weights(acc, trainable, model):  # each process embeds its share of the corpus: not in lockstep
            return evaluate_retrieval(model, corpus, dev_sets, cfg.eval.recall_at, acc, cfg.eval.batch_size,
                                      out_dir=run.dir / "eval" / f"step-{step}")

    def record_eval() -> float:
        """Evaluate into `history` (curves start at step 0, the initial model); returns the seconds it took."""
        eval_started = time.time()
        history.append({"step": step, **evaluate()})
        run.log(flat_metrics(history[-1]), step)
        return time.time() - eval_started

    def losses(parts: Trainable, questions: list[str], passages: list[dict], subset: Subset) -> dict:
        """Steps 2-3: everything with a gradient, run as the prepared module's forward."""
        # 2. fresh f(x) and g(y), y in S: each process encodes 1/N of S, gathered with gradient
        queries, passage_part = parts.retriever(questions, passages)
        vectors = gather_with_grad(passage_part, len(subset.rows), acc)
        # 3. losses over the subset
        scores = retrieval_scores(queries, vectors)
        task_loss, logged = strategy.task_loss(scores, subset)
        aux = strategy.auxiliary_loss(queries.detach(), subset.rows, vectors.detach(), scores.detach())
        return {"loss": task_loss, "aux": aux, "logged": logged}

    if cfg.train.eval_every and step == 0:
        record_eval()
    first_step, started, eval_seconds = step, time.time(), 0.0
    bar = tqdm(total=cfg.train.steps, initial=step, desc="retriever", disable=not acc.is_main_process)
    while step < cfg.train.steps:
        batch = [train_set[i] for i in local_slice(global_batch(len(train_set), cfg.train.batch_size, cfg.train.seed, step), acc)]
        questions = [ex.question for ex in batch]
        positives = torch.as_tensor(corpus.rows([ex.positive_ids[0] for ex in batch]))

        # 1. the passage subset, from query vectors without gradient (same questions, eval mode)
        with torch.no_grad():
            ctx.model.eval()
            query_probe = ctx.model.encode_queries(questions).float()
            ctx.model.train()
        subset = strategy.subset(query_probe, positives)

        # 2.-3. fresh vectors and the losses, in one forward of the prepared module
        mine = my_share(subset.rows, acc)
        out = trainable(losses, questions, corpus.passages(mine.tolist()), subset)
        task_loss, aux, logged = out["loss"], out["aux"], out["logged"]

        # 4. update (a non-finite step is skipped; a diverged corrector skips only its own update), then let the
        # strategy refresh its state with the new parameters
        optimizer_step(acc, task_loss, list(model.parameters()), optimizer, scheduler, guard, cfg.train.max_grad_norm,
                       aux=aux)
        step += 1
        strategy.after_step(step)
        bar.update(1)

        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            values = {"loss": task_loss.item(), "subset": len(subset.rows), "embedded": strategy.embedded,
                      **guard.counts(), **logged}
            if aux is not None:
                values["corrector_loss"] = aux.item()
            run.log(values, step)
            bar.set_postfix(loss=f"{values['loss']:.3f}")
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
            eval_seconds += record_eval()
        if cfg.train.save_every and step % cfg.train.save_every == 0 and step < cfg.train.steps:
            run.save(step, extra=strategy.save)
    bar.close()
    train_seconds = time.time() - started - eval_seconds  # training steps only: evaluations left out

    final = evaluate()
    run.save(step, extra=strategy.save)
    save_parts(acc, trainable, {"retriever": lambda m: m.save(run.dir / "retriever")})
    main_set = next(iter(final.values()))
    metrics = {
        "recall": main_set.get("recall", {}),
        "mrr@10": main_set.get("mrr@10"),
        "ndcg@10": main_set.get("ndcg@10"),
        "answer_recall": main_set.get("answer_recall", {}),
        "datasets": final,
        "reembedded_passages": strategy.embedded,
        "steps": step,
        "steps_per_second": (step - first_step) / train_seconds if step > first_step else None,
        "strategy": cfg.strategy.name,
        "history": history,
    }
    run.log(flat_metrics({"step": step, **final}), step)
    run.write_metrics(metrics)
    run.end()
    return metrics


def flat_metrics(entry: dict) -> dict[str, float]:
    """{"nq": {"recall": {"5": .4}}} -> {"eval/nq/recall@5": .4} for trackers."""
    out = {}
    for name, values in entry.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if isinstance(value, dict):
                out.update({f"eval/{name}/{key}@{k}": v for k, v in value.items()})
            elif isinstance(value, (int, float)):
                out[f"eval/{name}/{key}"] = value
    return out

"""Algorithm 1 of seed 000: supervised dense retrieval with a truncated softmax over a shared subset.

Per step, for a batch of (question x_i, positive y_i):
  1. S = union over the global batch of the strategy's top-k for each x_i (stale buffer, corrector-scored
     buffer, refreshed buffer, cache, ...) + uniform targets + every positive;
  2. fresh f(x_i) and g(y) for y in S, with gradient (each process encodes 1/N of S, gathered with grad);
  3. task loss = cross-entropy of softmax(beta <f(x_i), g(y)>) over S against y_i (the strategy may replace
     it, e.g. the negative cache's surrogate); auxiliary loss (the corrector's) on the same subset;
  4. one optimizer step; then the strategy updates its own state (refresh, FIFO, ...).

How the global batch reaches the gradient is `batching.name` (rag_train/train/batching/, seed 002): in one
forward (plain), or as K micro-batches under a memory cap — GradAccum, GradCache (the exact full-batch
gradient), ContAccum (memory banks of past queries and passages).

The retriever and the strategy's corrector are parts of ONE prepared module (`Trainable`, one optimizer) whose
forward is steps 2-3, as in the RLM recipe: the same loop runs on one process, under DDP and DeepSpeed ZeRO.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from rag_train.buffer.embed import buffer_local_shard
from rag_train.config import ConfigError
from rag_train.data.corpus import Corpus
from rag_train.data.sources import dataset_name, resolve_data
from rag_train.data.supervised import load_retrieval
from rag_train.eval.retrieval import evaluate_retrieval, load_eval_set
from rag_train.io import model_digest
from rag_train.models.retriever import DualEncoder
from rag_train.strategies import StrategyContext, build_strategy, strategy_class
from rag_train.train.batching import MicroBatch, StepParts, check_batching, tower_grad_norms
from rag_train.train.memory import PeakMemory
from rag_train.train.passages import ensure_buffer, ensure_token_cache
from rag_train.train.run import TrainingRun, flat_metrics, releases_on_input_fault, steps_per_second
from rag_train.train.schema import RetrieverTrainConfig
from rag_train.train.step import global_batch, linear_warmup, local_slice, optimizer_step
from rag_train.train.trainable import Trainable, deepspeed_stage, full_weights, save_parts


class RetrieverRecipe:
    """Algorithm 1 as a torchtune-style recipe, the shape of the RLM's (`RLMRecipe`): `setup()`, `train()`
    (`train_step` is one step of the algorithm above), `save()`. `final_eval=False` skips the closing corpus pass
    (the RLM's warm start: its dev recall comes from the stale buffer, which is this retriever's embedding of the
    corpus)."""

    def __init__(self, cfg: RetrieverTrainConfig, final_eval: bool = True):
        self.cfg, self.final_eval = cfg, final_eval
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # before any work
        self.option = check_batching(cfg.batching, strategy_class(cfg.strategy.name), cfg.train.batch_size, world)
        self.run = TrainingRun(cfg, "retriever")
        self.accelerator = self.run.accelerator
        if self.option.own_backward and deepspeed_stage(self.accelerator) is not None:
            raise ConfigError(f"batching.name={cfg.batching.name!r} runs several backward passes per optimizer step, "
                              "which DeepSpeed's engine (it steps inside each backward) cannot; "
                              "use batching.name=plain")
        self.step = 0
        self.history = self.run.history  # restored by run.resume(), checkpointed by run.save()

    # -- setup -----------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Data, the retriever, its token cache and stale buffer when the strategy reads one, the strategy, one AdamW
        over the retriever and the strategy's own parameters, the batching option; then the latest checkpoint when
        resuming."""
        cfg, acc = self.cfg, self.accelerator
        files = resolve_data(cfg.data, acc, ["retrieval-train"], ["retrieval-dev"],
                             {"retriever.model": cfg.retriever.model})
        corpus = self.corpus = Corpus.open(files.passages)
        self.run.check_corpus(corpus)  # k <= corpus size, same corpus on every process: before any long work
        for k in sorted(k for k in set(cfg.eval.recall_at) if k > len(corpus)):
            acc.print(f"warning: eval.recall_at={k} is larger than the corpus {corpus.path} ({len(corpus)} passages): "
                      f"recall@{k} is reported over the whole corpus (= recall@{len(corpus)})")
        self.train_set = [ex for path in files.train
                          for ex in load_retrieval(path, corpus=corpus)][: cfg.data.max_train_examples]
        self.dev_sets = {dataset_name(p): load_eval_set(p, corpus, limit=cfg.data.max_eval_examples,
                                                        empty_answers=cfg.data.empty_answers) for p in files.dev}

        model = DualEncoder.from_config(cfg.retriever, tokenizer=cfg.retriever.tokenizer or files.tokenizer)
        needs_buffer = strategy_class(cfg.strategy.name).needs_buffer
        if needs_buffer or self.final_eval or cfg.train.eval_every:  # else no corpus pass (the RLM's warm start)
            ensure_token_cache(self.run, cfg.buffer, model, corpus)
        self.buffer_dir = ensure_buffer(self.run, cfg.buffer, model, corpus) if needs_buffer else None
        ctx = StrategyContext(acc, model, corpus, cfg.buffer, self.buffer_dir, cfg.train.temperature, cfg.train.seed)
        self.strategy = strategy = build_strategy(cfg.strategy, ctx)
        self.run.guard.aux_max_loss = strategy.auxiliary_max_loss

        params = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.train.lr,
                   "weight_decay": cfg.train.weight_decay}] + strategy.param_groups()
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr)
        scheduler = linear_warmup(optimizer, cfg.train.warmup_steps)
        self.trainable, self.optimizer, self.scheduler = self.run.prepare(
            Trainable(retriever=model, **strategy.modules()), optimizer, scheduler)
        self.model = ctx.model = acc.unwrap_model(self.trainable).retriever  # the same module, on the device
        ctx.gather = lambda *modules: full_weights(acc, self.trainable, *modules)
        self.batching = self.option(cfg.batching.selected(),
                                    StepParts(acc, self.trainable, self.model, strategy, corpus, cfg.train.temperature))
        self.step = self.run.resume()
        if self.step:
            strategy.load(self.run.latest_checkpoint())
            self.batching.load(self.run.latest_checkpoint())

    def save_state(self, directory) -> None:
        """What a checkpoint holds beside the run's own state: the strategy's and the batching option's."""
        self.strategy.save(directory)
        self.batching.save(directory)

    # -- training --------------------------------------------------------------------------------------

    def train_step(self, step: int) -> tuple:
        """One step of Algorithm 1 on the global batch of `step`: (the batching option's output, the towers' gradient
        norms when they were measured)."""
        cfg, acc, corpus = self.cfg, self.accelerator, self.corpus
        indices = global_batch(len(self.train_set), cfg.train.batch_size, cfg.train.seed, step)
        micro_batches = []  # K contiguous parts of the global batch, each split over the processes
        for part in np.split(indices, cfg.batching.micro_batches):
            batch = [self.train_set[i] for i in local_slice(part, acc)]
            positives = torch.as_tensor(corpus.rows([ex.positive_ids[0] for ex in batch]))
            micro_batches.append(MicroBatch([ex.question for ex in batch], positives))

        # 1.-3. subsets, fresh vectors and losses (back-propagated by the option when it takes several passes)
        out = self.batching.step(micro_batches)
        grad_norms: dict = {}

        # 4. update (a non-finite step is skipped; a diverged corrector skips only its own update); the caller then
        # lets the strategy refresh its state with the new parameters
        optimizer_step(acc, out.loss, list(self.model.parameters()), self.optimizer, self.scheduler, self.run.guard,
                       cfg.train.max_grad_norm, aux=out.aux, backward=not out.backward_done,
                       on_gradients=lambda: grad_norms.update(tower_grad_norms(self.model)))
        return out, grad_norms

    def train(self) -> None:
        """Steps until `train.steps`, with evaluations (curves start at step 0, the initial model) and checkpoints;
        the training steps' own seconds are kept for steps/s."""
        cfg, acc, run, strategy = self.cfg, self.accelerator, self.run, self.strategy
        if cfg.train.eval_every and self.step == 0:
            self.record_eval()
        first_step, started, eval_seconds = self.step, time.time(), 0.0
        bar = tqdm(total=cfg.train.steps, initial=self.step, desc="retriever", disable=not acc.is_main_process)
        memory = PeakMemory(acc.device, cfg.batching.memory_fraction)
        self.peak_memory = 0.0
        self.grad_ratios = run.totals.setdefault("grad_ratio_passage_query", [])  # checkpointed: resume keeps it
        while self.step < cfg.train.steps:
            memory.reset()
            out, grad_norms = self.train_step(self.step)
            self.step += 1
            step = self.step
            strategy.after_step(step)
            bar.update(1)
            step_peak = memory.peak_mib()
            if "grad_ratio_passage_query" in grad_norms:
                self.grad_ratios.append(grad_norms["grad_ratio_passage_query"])
            for key, value in out.logged.items():  # ContAccum's probe: checkpointed per step, like grad_ratios
                if key.startswith("probe/"):
                    run.totals.setdefault(f"by_step/{key}", []).append(value)
            self.peak_memory = max(self.peak_memory, step_peak)

            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                values = {"loss": out.loss.item(), "subset": out.columns, "embedded": strategy.embedded,
                          "peak_memory_mib": step_peak, **grad_norms, **run.guard.counts(), **out.logged}
                if out.aux is not None:
                    values["corrector_loss"] = out.aux.item()
                strategy_values = strategy.logged_values()
                run.record_strategy_values(step, strategy_values)
                values.update(strategy_values)
                run.log(values, step)
                bar.set_postfix(loss=f"{values['loss']:.3f}")
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                eval_seconds += self.record_eval()
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < cfg.train.steps:
                run.save(step, extra=self.save_state)
            run.stop_if_signalled(step, extra=self.save_state)
        bar.close()
        # training steps only: evaluations left out
        self.steps_per_second = steps_per_second(first_step, self.step, time.time() - started - eval_seconds)

    # -- evaluation and the end ------------------------------------------------------------------------

    def evaluate(self, final: bool) -> dict:
        """Exact, over the corpus embedded now: at the end, and during training up to `eval.fresh_rows` rows;
        beyond that, over the stale buffer (no corpus pass) when the strategy has one. Each set's ranking also
        lands in `<run>/eval/step-<step>/<set>.trec`."""
        cfg, acc, corpus = self.cfg, self.accelerator, self.corpus
        over_buffer = not final and self.buffer_dir is not None and len(corpus) > cfg.eval.fresh_rows
        out_dir = self.run.dir / "eval" / f"step-{self.step}"
        with full_weights(acc, self.trainable, self.model):  # each process embeds its share: not in lockstep
            if over_buffer:
                return evaluate_retrieval(self.model, corpus, self.dev_sets, cfg.eval.recall_at, acc,
                                          cfg.eval.batch_size, out_dir=out_dir,
                                          shard=buffer_local_shard(self.buffer_dir, acc))
            with self.run.passes.timed("final evaluation" if final else f"evaluation at step {self.step}",
                                       len(corpus)):
                return evaluate_retrieval(self.model, corpus, self.dev_sets, cfg.eval.recall_at, acc,
                                          cfg.eval.batch_size, out_dir=out_dir,
                                          embed_workers=cfg.buffer.embed_workers)

    def record_eval(self) -> float:
        """Evaluate into `history` (curves start at step 0, the initial model); returns the seconds it took."""
        eval_started = time.time()
        self.history.append({"step": self.step, **self.evaluate(final=False)})
        self.run.log(flat_metrics(self.history[-1]), self.step)
        return time.time() - eval_started

    def save(self) -> dict:
        """The last checkpoint, the final evaluation (unless `final_eval=False`), the trained retriever and
        metrics.json (returned)."""
        cfg, run, step, strategy = self.cfg, self.run, self.step, self.strategy
        run.save(step, extra=self.save_state)  # first: a final evaluation that fails is redone by resuming from here
        final = self.evaluate(final=True) if self.final_eval else {}
        save_parts(self.accelerator, self.trainable, {"retriever": lambda m: m.save(run.dir / "retriever")})
        main_set = next(iter(final.values()), {})
        grad_ratios = self.grad_ratios
        metrics = {
            "recall": main_set.get("recall", {}),
            "mrr@10": main_set.get("mrr@10"),
            "ndcg@10": main_set.get("ndcg@10"),
            "answer_recall": main_set.get("answer_recall", {}),
            "datasets": final,
            "reembedded_passages": strategy.embedded,
            "strategy_summary": strategy.summary(),  # the strategy's own values (memory, re-encoding counts, ...)
            "steps": step,
            "steps_per_second": self.steps_per_second,
            "strategy": cfg.strategy.name,
            "batching": cfg.batching.name,
            # the init's weights (None: `tiny` or a hub id): rows compared as from one init must show the same
            "init_digest": model_digest(cfg.retriever.model),
            # the vectorised CPU kernels that ran (they round differently; the reproduction pins AVX2)
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "peak_memory_mib": self.peak_memory,  # over this process's steps (CPU: peak RSS; CUDA: max allocated)
            # mean over this run's steps of ||grad passage tower|| / ||grad query tower|| (None: shared towers)
            "grad_ratio_passage_query": sum(grad_ratios) / len(grad_ratios) if grad_ratios else None,
            "grad_ratio_by_step": list(grad_ratios),  # seed 002's Figure 5: one value per optimizer step, from step 1
            # ContAccum's `batching.probe_gradients` values, one per optimizer step from step 1 (empty without it)
            "by_step": {k.removeprefix("by_step/"): v for k, v in run.totals.items() if k.startswith("by_step/")},
            "history": self.history,
            # per logged step (train.log_every): the strategy's own values, e.g. the corrector's tracking on its subset
            "strategy_log": run.strategy_log(),
        }
        run.log(flat_metrics({"step": step, **final}), step)
        run.write_metrics(metrics)
        run.end()
        return metrics


@releases_on_input_fault
def train_retriever(cfg: RetrieverTrainConfig, final_eval: bool = True) -> dict:
    """Algorithm 1 end to end (`RetrieverRecipe`); returns what metrics.json holds. `final_eval=False` skips the
    closing corpus pass (the RLM's warm start)."""
    recipe = RetrieverRecipe(cfg, final_eval)
    recipe.setup()
    recipe.train()
    return recipe.save()

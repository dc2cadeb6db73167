"""Generative retrieval (seed 003): a T5 learns to write the identifier of a question's target, maximising
P(t | q) = prod_i P(t_i | q, t_<i), and retrieves by beam search under a trie of valid identifiers.

With Np Decoding the output vocabulary is the frozen CE table (`rag_train.generative.ce_table`):
  BASE   CE from the initial encoder, built once before training;
  ASYNC  CE rebuilt from the current encoder every `np.rebuild_every_epochs` epochs (labels and trie follow);
  CONTRA first `np.contrastive_steps` of token-level contrastive learning (the first decoder output against all
         CE rows, the target's own rows positive), then CE rebuilt from that encoder, then generative training.
Vanilla decoding (`np.enabled=false`) is the same loop over the T5 vocabulary.

The loop follows the shared conventions (`train.run`, `train.step`): data order a function of (seed, step), one prepared
module, atomic checksummed checkpoints (plus a pointer to the CE table in use), metrics.json at the end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers.optimization import Adafactor

from rag_train.config import ConfigError
from rag_train.data.corpus import Corpus
from rag_train.data.sources import dataset_name, resolve_data
from rag_train.data.supervised import load_retrieval
from rag_train.data.tokenizer import load_tokenizer
from rag_train.generative.ce_table import (
    CETable,
    build_ce_table,
    ce_folder,
    encoder_fingerprint,
    load_ce_table,
    save_ce_table,
)
from rag_train.generative.config import GenerativeConfig
from rag_train.generative.model import GenerativeT5, load_generator, token_contrastive_loss
from rag_train.generative.search import rank_targets, ranking_metrics
from rag_train.generative.targets import Targets, build_targets
from rag_train.generative.trie import Trie
from rag_train.io import atomic_write_json, read_json
from rag_train.train.run import (
    TrainingRun,
    flat_metrics,
    releases_on_input_fault,
    save_pretrained_atomic,
    steps_per_second,
)
from rag_train.train.step import global_batch, linear_warmup, local_slice, optimizer_step
from rag_train.train.trainable import Trainable

CE_POINTER = "ce.json"  # in a checkpoint / the saved generator: which stored CE table goes with the weights


class OutputSpace:
    """What the generator writes for each target, and the trie over it: vocabulary ids + end token (vanilla) or
    CE rows (Np Decoding)."""

    def __init__(self, paths: list[list[int]], end_ids: list[int], table: Optional[CETable] = None):
        self.paths, self.end_ids, self.table = paths, end_ids, table
        self.trie = Trie(paths)

    @classmethod
    def vanilla(cls, targets: Targets, eos: int) -> "OutputSpace":
        return cls([tokens + [eos] for tokens in targets.tokens], [eos])

    @classmethod
    def np_decoding(cls, table: CETable, eos: int) -> "OutputSpace":
        return cls(table.paths, table.end_rows(eos), table)

    def labels(self, target_ids: list[int]) -> torch.Tensor:
        """[B, longest path] output ids, -100 after each path's end."""
        width = max(len(self.paths[t]) for t in target_ids)
        labels = torch.full((len(target_ids), width), -100, dtype=torch.long)
        for i, t in enumerate(target_ids):
            labels[i, : len(self.paths[t])] = torch.as_tensor(self.paths[t])
        return labels

    def positives(self, target_ids: list[int], rows: int) -> torch.Tensor:
        """[B, R] CONTRA's positives: the CE rows of each target's own tokens (its end row excluded)."""
        mask = torch.zeros(len(target_ids), rows, dtype=torch.bool)
        for i, t in enumerate(target_ids):
            mask[i, self.paths[t][:-1]] = True
        return mask


def ensure_ce(run: TrainingRun, generator: GenerativeT5, targets: Targets, corpus: Corpus, tokenizer,
              cfg: GenerativeConfig) -> CETable:
    """The CE table of the generator's encoder as it is now: found in `np.ce_dir` when this exact encoder and
    these targets built one before, else built by the main process and stored; every process opens it."""
    acc = run.accelerator
    settings = {"context_length": cfg.targets.context_length, "clusters_per_token": cfg.np.clusters_per_token,
                "kmeans_iters": cfg.np.kmeans_iters, "seed": cfg.train.seed}
    model_fp = encoder_fingerprint(generator.encoder, **settings)
    directory = ce_folder(Path(cfg.np.ce_dir) if cfg.np.ce_dir else run.dir / "ce", model_fp, targets.fingerprint)
    run.agree(ce_encoder=model_fp)
    if acc.is_main_process and not (directory / "manifest.json").is_file():
        table = build_ce_table(generator.encoder, targets, corpus, tokenizer, cfg.targets.context_length,
                               cfg.np.clusters_per_token, cfg.np.kmeans_iters, cfg.train.seed,
                               cfg.np.build_batch_size, progress=True)
        save_ce_table(table, directory, model_fp, targets.fingerprint)
    acc.wait_for_everyone()
    return load_ce_table(directory, model_fp, targets.fingerprint)


def _generator_and_tokenizer(cfg: GenerativeConfig, toy_tokenizer: Optional[str]):
    """A tiny model needs its tokenizer first; a checkpoint is loaded first, so that an unreachable hub id fails
    before its tokenizer is looked up (ReaderLoadError, naming what to download)."""
    if cfg.generator.model == "tiny":
        if not (cfg.generator.tokenizer or toy_tokenizer):
            raise ConfigError("generator.model=tiny needs generator.tokenizer (or data.toy=true for the toy one)")
        tokenizer = load_tokenizer(cfg.generator.tokenizer or toy_tokenizer)
        return load_generator("tiny", tokenizer, cfg.generator.tiny), tokenizer
    generator = load_generator(cfg.generator.model, None)
    return generator, load_tokenizer(cfg.generator.tokenizer or cfg.generator.model)


def _examples(path: str, corpus: Corpus, targets: Targets, limit: Optional[int]) -> tuple[list[str], list[list[int]]]:
    examples = load_retrieval(path, corpus=corpus, limit=limit)
    return [ex.question for ex in examples], [targets.gold(corpus, ex) for ex in examples]


class GenerativeRecipe:
    """Generative retrieval (seed 003) as a recipe of the RLM's and the retriever's shape: `setup()`, `train()`
    (`train_step` is one step: CONTRA's contrastive stage first, then teacher-forced target titles or ids under the
    output space), `save()`. With Np Decoding the output space is a CE table, rebuilt on ASYNC's schedule and after
    CONTRA's stage."""

    def __init__(self, cfg: GenerativeConfig):
        self.cfg = cfg
        self.run = TrainingRun(cfg, "generative")
        self.accelerator = self.run.accelerator
        self.step = 0
        self.history = self.run.history  # restored by run.resume(), checkpointed by run.save()

    def setup(self) -> None:
        """The generator (first: an offline hub id fails at once), the corpus and its targets, the (question, target)
        pairs, the optimizer, the latest checkpoint when resuming, and the output space (the CE table the checkpoint
        was trained with, or a new one)."""
        cfg, acc, run = self.cfg, self.accelerator, self.run
        files = resolve_data(cfg.data, acc, ["retrieval-train"], ["retrieval-dev"])
        generator, self.tokenizer = _generator_and_tokenizer(cfg, files.tokenizer)
        with acc.main_process_first():
            corpus = self.corpus = Corpus.open(files.passages)
        run.agree(corpus_fingerprint=corpus.fingerprint)
        targets = self.targets = build_targets(corpus, self.tokenizer, cfg.targets.identifier,
                                               progress=acc.is_main_process)
        train_questions, train_gold = [], []
        for path in files.train:
            questions, gold = _examples(path, corpus, targets, None)
            train_questions += questions
            train_gold += gold
        # one (question, target) pair per gold target: a multi-hop question trains on each of its titles (GENRE / KILT)
        pairs = [(q, t) for q, gold in zip(train_questions[: cfg.data.max_train_examples], train_gold) for t in gold]
        self.train_questions, self.train_targets = [q for q, _ in pairs], [t for _, t in pairs]
        self.dev_sets = {dataset_name(p): _examples(p, corpus, targets, cfg.data.max_eval_examples)
                         for p in files.dev}

        optimizer = (Adafactor(generator.parameters(), lr=cfg.train.lr, scale_parameter=False, relative_step=False,
                               warmup_init=False, weight_decay=cfg.train.weight_decay) if cfg.optimizer == "adafactor"
                     else torch.optim.AdamW(generator.parameters(), lr=cfg.train.lr,
                                            weight_decay=cfg.train.weight_decay))
        scheduler = linear_warmup(optimizer, cfg.train.warmup_steps)
        self.model, self.optimizer, self.scheduler = run.prepare(Trainable(generator=generator), optimizer, scheduler)
        self.generator = acc.unwrap_model(self.model).generator  # the same module, on the device
        self.eos = self.tokenizer.eos_token_id

        self.step = run.resume()
        self.contrastive = cfg.np.contrastive_steps if cfg.np.enabled else 0
        self.total = self.contrastive + cfg.train.steps
        self.rebuild_every = (rebuild_interval(cfg.np.rebuild_every_epochs, len(self.train_questions),
                                               cfg.train.batch_size) if cfg.np.variant == "async" else 0)
        # checkpointed with the run: a resumed run keeps the earlier ones
        self.ce_builds = run.totals.setdefault("ce_builds", [])
        if not cfg.np.enabled:
            self.space = OutputSpace.vanilla(targets, self.eos)
        elif self.step:  # resuming: the table the checkpoint was trained with (recorded in ce_builds when built)
            pointer = read_json(run.latest_checkpoint() / CE_POINTER)
            inside = pointer.get("in_run")  # a table in the run's own folder is found there, wherever the run moved
            directory = run.dir / inside if inside and (run.dir / inside).is_dir() else Path(pointer["directory"])
            self.space = self.use_table(load_ce_table(directory, targets_fingerprint=targets.fingerprint),
                                        record=False)
        else:
            self.space = self.use_table(self.build_table())

    def build_table(self) -> CETable:
        return ensure_ce(self.run, self.generator, self.targets, self.corpus, self.tokenizer, self.cfg)

    def use_table(self, table: CETable, record: bool = True) -> OutputSpace:
        """Np Decoding's output space over `table`, set into the generator (recorded in `ce_builds` at this step)."""
        self.generator.set_ce(table.vectors, table.row_token, self.cfg.np.decoder_inputs)
        if record:
            self.ce_builds.append({"step": self.step, "directory": str(table.directory), "rows": len(table.vectors)})
        return OutputSpace.np_decoding(table, self.eos)

    def save_pointer(self, folder: Path) -> None:
        """Where the CE table of the output space is, beside a checkpoint or the saved generator."""
        run, space = self.run, self.space
        if self.accelerator.is_main_process and space.table is not None:
            table = Path(space.table.directory).resolve()
            inside = table.relative_to(run.dir.resolve()).as_posix() if run.dir.resolve() in table.parents else None
            atomic_write_json(folder / CE_POINTER, {"directory": str(space.table.directory), "in_run": inside})

    def evaluate(self) -> dict:
        """Each process beam-searches its share of every dev set; the rankings are gathered."""
        cfg, acc, space = self.cfg, self.accelerator, self.space
        out = {}
        for name, (questions, gold) in self.dev_sets.items():
            share = local_slice_range(len(questions), acc.process_index, acc.num_processes)
            ranked = rank_targets(self.generator, self.tokenizer, questions[share.start:share.stop], space.trie,
                                  space.end_ids, cfg.eval.num_beams, cfg.generator.max_question_length,
                                  cfg.eval.batch_size, progress=acc.is_main_process)
            ranked = [r for part in gather_object([ranked]) for r in part] if acc.num_processes > 1 else ranked
            out[name] = ranking_metrics(ranked, gold, cfg.eval.recall_at)
        return out

    def train_step(self, step: int) -> torch.Tensor:
        """One step on the global batch of `step` (its CE table rebuilt first when the schedule says); its loss."""
        cfg, acc, space = self.cfg, self.accelerator, self.space
        if space.table is not None and step and (step == self.contrastive and cfg.np.variant == "contra"
                                                 or self.rebuild_every and step % self.rebuild_every == 0):
            space = self.space = self.use_table(self.build_table())
        picked = local_slice(global_batch(len(self.train_questions), cfg.train.batch_size, cfg.train.seed, step), acc)
        batch_targets = [self.train_targets[i] for i in picked]
        inputs = self.tokenizer([self.train_questions[i] for i in picked], padding=True, truncation=True,
                                max_length=cfg.generator.max_question_length, return_tensors="pt").to(acc.device)
        if step < self.contrastive:  # CONTRA's stage: the first decoder output against every CE row
            positives = space.positives(batch_targets, len(self.generator.ce)).to(acc.device)
            loss = self.model(lambda parts: token_contrastive_loss(
                parts.generator.first_output_state(inputs["input_ids"], inputs["attention_mask"]),
                parts.generator.ce, positives))
        else:
            labels = space.labels(batch_targets).to(acc.device)
            loss = self.model(lambda parts: parts.generator(**inputs, labels=labels).loss)
        optimizer_step(acc, loss, list(self.model.parameters()), self.optimizer, self.scheduler, self.run.guard,
                       cfg.train.max_grad_norm)
        return loss

    def train(self) -> None:
        """Steps until the contrastive stage and `train.steps` are done, with evaluations and checkpoints."""
        cfg, run, total = self.cfg, self.run, self.total
        if cfg.train.eval_every and self.step == 0:
            self.history.append({"step": 0, **self.evaluate()})
        started, first_step = time.time(), self.step
        bar = tqdm(total=total, initial=self.step, desc="generative", disable=not self.accelerator.is_main_process)
        while self.step < total:
            loss = self.train_step(self.step)
            self.step += 1
            step = self.step
            bar.update(1)
            if step % cfg.train.log_every == 0 or step == total:
                run.log({"loss" if step > self.contrastive else "contrastive_loss": loss.item()}, step)
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < total:
                self.history.append({"step": step, **self.evaluate()})
                run.log(flat_metrics(self.history[-1]), step)
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < total:
                run.save(step, extra=self.save_pointer)
            run.stop_if_signalled(step, extra=self.save_pointer)
        bar.close()
        self.steps_per_second = steps_per_second(first_step, self.step, time.time() - started)

    def save(self) -> dict:
        """The last checkpoint, the final evaluation, the generator with its CE pointer, metrics.json (returned)."""
        cfg, acc, run, step, space = self.cfg, self.accelerator, self.run, self.step, self.space
        run.save(step, extra=self.save_pointer)  # first: a final evaluation that fails is redone by resuming from here
        final = self.evaluate()
        if acc.is_main_process:
            save_pretrained_atomic(run.dir / "generator", self.generator, self.tokenizer)
            self.save_pointer(run.dir / "generator")
        acc.wait_for_everyone()
        main = next(iter(final.values()))
        metrics = {"r_precision": main["r_precision"], "recall": main["recall"], "datasets": final,
                   "decoding": f"np-{cfg.np.variant}" if cfg.np.enabled else "vanilla", "targets": len(self.targets),
                   "ce_rows": len(space.table.vectors) if space.table is not None else None,
                   "ce_builds": list(self.ce_builds), "steps": step,
                   "steps_per_second": self.steps_per_second,
                   "history": self.history}
        run.log(flat_metrics({"step": step, **final}), step)
        run.write_metrics(metrics)
        run.end()
        return metrics


@releases_on_input_fault
def train_generative(cfg: GenerativeConfig) -> dict:
    """Generative retrieval end to end (`GenerativeRecipe`); returns what metrics.json holds."""
    recipe = GenerativeRecipe(cfg)
    recipe.setup()
    recipe.train()
    return recipe.save()


def rebuild_interval(epochs: float, examples: int, batch_size: int) -> int:
    """ASYNC's steps between CE rebuilds: `epochs` passes over `examples` in steps of `batch_size`, counted in
    examples (8 epochs of 6,000 pairs at batch 32 are 1,500 steps; rounding an epoch down to 187 steps first would put
    a 4th rebuild at step 5,984, 16 steps before a 6,000-step run ends)."""
    return max(1, round(epochs * examples / batch_size))


def local_slice_range(n: int, rank: int, world: int) -> range:
    """Contiguous share `rank` of `world` of n items (the first shares take the remainder)."""
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    return range(start, start + per + (rank < extra))



def print_generative_table(cfg: GenerativeConfig, metrics: dict) -> None:
    """One line per dev set: R-precision and recall@k (main process only)."""
    from accelerate import PartialState

    if not PartialState().is_main_process:
        return
    ks = sorted(metrics["recall"], key=int)
    lines = [f"\ngenerative retrieval ({metrics['decoding']}, {metrics['targets']} targets, {metrics['steps']} steps) "
             f"-> {cfg.train.output_dir}", "| dataset | R-prec | " + " | ".join(f"R@{k}" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    for name, values in metrics["datasets"].items():
        lines.append(f"| {name} | {100 * values['r_precision']:.1f} | "
                     + " | ".join(f"{100 * values['recall'][k]:.1f}" for k in ks) + " |")
    print("\n".join(lines))

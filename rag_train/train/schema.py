"""The training recipes' config schemas: `RetrieverTrainConfig` (Algorithm 1, scripts/train_retriever.py) and
`RLMConfig` (Algorithm 2, scripts/train_rlm.py). They compose the shared sections of `rag_train.config` with
the `strategy` section, whose keys the strategy modules declare (`rag_train.strategies.StrategyConfig`);
which recipe a strategy runs in is its own declaration too (`Strategy.algorithms`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rag_train.config import (
    BufferConfig,
    ConfigError,
    DataConfig,
    EvalConfig,
    ReaderConfig,
    RetrieverConfig,
    TrainConfig,
    absolute_path,
    check_choice,
    check_positive,
)
from rag_train.data.sources import TOY_LM_MANIFEST
from rag_train.strategies import StrategyConfig, require_algorithm, require_search
from rag_train.train.batching import BatchingConfig

FINE_TUNING_MAX_LR = 1e-4  # above this, AdamW steps wreck a pretrained encoder within a few steps


def warn_if_lr_wrecks_pretrained(retriever: RetrieverConfig, key: str, lr: float) -> None:
    """Warn when a pretrained retriever (anything but `tiny`) is to be trained at a from-scratch learning rate."""
    toy_lm = (Path(retriever.model) / TOY_LM_MANIFEST).is_file()  # a tiny toy model trains at toy rates
    if retriever.model != "tiny" and not toy_lm and lr > FINE_TUNING_MAX_LR:
        warnings.warn(
            f"retriever.model={retriever.model!r} is a pretrained checkpoint, and {key}={lr:g} is far above the "
            f"rates pretrained encoders are fine-tuned at (1e-5 to 5e-5 with AdamW; > {FINE_TUNING_MAX_LR:g} here "
            f"warns): a few such steps can undo the pretraining. Lower {key} "
            "(see configs/retriever/toy_minilm_finetune.yaml).",
            UserWarning, stacklevel=2)


@dataclass
class RetrieverTrainConfig:
    """Algorithm 1: supervised dense retrieval."""

    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        require_algorithm("strategy.name", self.strategy.name, 1, "the retriever recipe")
        warn_if_lr_wrecks_pretrained(self.retriever, "train.lr", self.train.lr)
        require_search(self.strategy.name, self.buffer.search)


@dataclass
class WarmStartConfig:
    """Stand-ins for pre-training when models start from random weights (the toy default).

    A real run starts from T5 that can read and GTR that can retrieve. Tiny random models cannot, and
    perplexity distillation from a reader that cannot read has no signal (it collapses the retriever).
    So the toy pipeline first trains the reader on gold passages mixed with random ones, and the retriever
    with the supervised recipe (Algorithm 1) on the gold passages; both stages are skipped at 0 steps.
    """

    reader_steps: int = 0
    # Adafactor's lr (T5's pre-training optimizer; each step is scaled by the weight's RMS)
    reader_lr: float = 1e-2
    reader_passages: int = 2  # gold passage(s) + distractors per question, in random order
    # distractors: `random` passages, or `retrieved`: the warm-started retriever's top-ranked non-gold ones,
    # as a FiD reader is trained on its retriever's output (the confusable passages it will see later)
    reader_distractors: str = "random"
    # the first steps show single-hop questions their gold passage alone: a tiny T5 learns to copy an answer
    # there within a few hundred steps, and then to find the right passage among several much faster
    reader_copy_steps: int = 0
    reader_batch_size: int = 32
    retriever_steps: int = 0
    retriever_strategy: str = "in_batch"
    retriever_lr: float = 1e-3  # the warm-start stage's Algorithm 1 lr (the RLM's own is the top-level `retriever_lr`)
    retriever_batch_size: int = 32
    retriever_train: Optional[str] = None  # DPR-format file; default: the toy world's retrieval-train
    # reuse the warm-start outputs of an earlier run (its warm_start_retriever/ and warm_start_reader/), so
    # that baselines (frozen, closed book, ...) start from exactly the same models
    from_run: Optional[str] = None

    def __post_init__(self) -> None:
        check_positive("warm_start", "reader_steps", self.reader_steps, allow_zero=True)
        check_positive("warm_start", "retriever_steps", self.retriever_steps, allow_zero=True)
        check_positive("warm_start", "reader_lr", self.reader_lr)
        check_positive("warm_start", "reader_passages", self.reader_passages)
        check_positive("warm_start", "reader_copy_steps", self.reader_copy_steps, allow_zero=True)
        check_positive("warm_start", "reader_batch_size", self.reader_batch_size)
        check_positive("warm_start", "retriever_lr", self.retriever_lr)
        require_algorithm("warm_start.retriever_strategy", self.retriever_strategy, 1, "the retriever warm start")
        check_choice("warm_start", "reader_distractors", self.reader_distractors, ("random", "retrieved"))
        self.retriever_train = absolute_path(self.retriever_train)  # see DataConfig
        self.from_run = str(Path(self.from_run).resolve()) if self.from_run else self.from_run


@dataclass
class RLMConfig:
    """Algorithm 2: FiD reader + retriever trained by perplexity distillation."""

    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    strategy: StrategyConfig = field(default_factory=lambda: StrategyConfig(top_k=32, uniform_negatives=0))
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    reader_temperature: float = 1.0  # temperature on reader log-likelihoods in P_a
    # lr of the retriever's parameters in Algorithm 2 (null = train.lr; the warm start has warm_start.retriever_lr);
    # Atlas keeps a separate retriever lr. Slower retriever drift is easier for the corrector to track.
    retriever_lr: Optional[float] = None
    retriever_start_step: int = 0  # retriever loss switched on no earlier than this step
    # ...and only once the reader's answer likelihoods discriminate between passages: the running mean of
    # the P_a mass on passages that contain an answer string, minus the share of such passages, must
    # exceed this (0 = no gate). A reader that cannot read gives noise, and distilling noise destroys
    # the retriever (measured: toy R@1 1.00 -> 0.21 in 300 steps with an ungated 3%-EM reader).
    pdist_gate: float = 0.0
    # collapse guard: retriever updates stop (with a warning) if the spread of the batch's passage vectors,
    # 1 - mean pairwise cosine, falls below this (0 = off).
    min_embedding_spread: float = 0.0

    def __post_init__(self) -> None:
        check_positive("", "reader_temperature", self.reader_temperature)
        warn_if_lr_wrecks_pretrained(self.retriever, "retriever_lr" if self.retriever_lr else "train.lr",
                                     self.retriever_lr or self.train.lr)
        if self.warm_start.retriever_steps:
            warn_if_lr_wrecks_pretrained(self.retriever, "warm_start.retriever_lr", self.warm_start.retriever_lr)
        if self.retriever_lr is not None:
            check_positive("", "retriever_lr", self.retriever_lr)
        check_positive("", "retriever_start_step", self.retriever_start_step, allow_zero=True)
        check_positive("", "min_embedding_spread", self.min_embedding_spread, allow_zero=True)
        if not 0 <= self.pdist_gate < 1:
            raise ConfigError(f"pdist_gate={self.pdist_gate} must be in [0, 1)")
        require_algorithm("strategy.name", self.strategy.name, 2, "the RLM recipe")
        require_search(self.strategy.name, self.buffer.search)

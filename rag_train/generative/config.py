"""Keys of the generative-retrieval recipe (`scripts/train_generative.py`), each documented where declared.

The shared sections (`data`, `train`, the tiny-model shape) are those of `rag_train.config`; the sections
below belong to this recipe alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rag_train.config import (
    ConfigError,
    DataConfig,
    TinyModelConfig,
    TrainConfig,
    check_choice,
    check_positive,
    check_recall_at,
)

VARIANTS = ("base", "async", "contra")


@dataclass
class GeneratorConfig:
    """The seq2seq model that writes identifiers: a tiny random T5 or a T5 checkpoint (hub id or folder)."""

    model: str = "tiny"  # tiny | google/t5-base-lm-adapt | a local T5 folder (save_pretrained format)
    tokenizer: Optional[str] = None  # default: the model's own (the toy tokenizer for `tiny`)
    max_question_length: int = 32  # question tokens fed to the encoder
    tiny: TinyModelConfig = field(default_factory=lambda: TinyModelConfig(d_model=128, d_ff=256, d_kv=16,
                                                                          num_heads=8))

    def __post_init__(self) -> None:
        check_positive("generator", "max_question_length", self.max_question_length)


@dataclass
class TargetsConfig:
    """What a target is and how it is written."""

    # title: one target per distinct passage title (GENRE; the gold targets of a question are its positive
    # passages' titles); id: one target per passage, written as its corpus id
    identifier: str = "title"
    # tokens of "<identifier> </s> <passage text>" the CE encoder reads per target (the target's first passage)
    context_length: int = 64

    def __post_init__(self) -> None:
        check_choice("targets", "identifier", self.identifier, ("title", "id"))
        check_positive("targets", "context_length", self.context_length)


@dataclass
class NpConfig:
    """Nonparametric Decoding (seed 003). `enabled: false` is vanilla decoding over the T5 vocabulary."""

    enabled: bool = True
    # base: CE from the initial encoder, built once; async: rebuilt from the current encoder every
    # `rebuild_every_epochs` epochs; contra: a token-level contrastive stage first, CE rebuilt from its encoder
    variant: str = "base"
    # k-means centroids kept per vocabulary token (a token with fewer occurrences keeps all its rows);
    # 0 = no reduction, one row per (target, position)
    clusters_per_token: int = 4
    kmeans_iters: int = 20
    # decoder INPUT at step t: `vocab` = the model's own (trainable) embedding of the previous row's token;
    # `ce` = the previous CE row itself (frozen). Output logits are over CE rows either way.
    decoder_inputs: str = "vocab"
    rebuild_every_epochs: float = 20.0  # async: the paper's N = 20
    contrastive_steps: int = 0  # contra: steps of the token-level contrastive stage, before train.steps generative ones
    ce_dir: Optional[str] = None  # where CE tables are stored, one folder per encoder fingerprint (default run_dir/ce)
    build_batch_size: int = 128  # targets per CE-encoder batch

    def __post_init__(self) -> None:
        check_choice("np", "variant", self.variant, VARIANTS)
        check_choice("np", "decoder_inputs", self.decoder_inputs, ("vocab", "ce"))
        check_positive("np", "clusters_per_token", self.clusters_per_token, allow_zero=True)
        check_positive("np", "kmeans_iters", self.kmeans_iters)
        check_positive("np", "rebuild_every_epochs", self.rebuild_every_epochs)
        check_positive("np", "contrastive_steps", self.contrastive_steps, allow_zero=True)
        check_positive("np", "build_batch_size", self.build_batch_size)
        if self.variant == "contra" and self.contrastive_steps == 0:
            raise ConfigError("np.variant=contra needs np.contrastive_steps > 0 (the contrastive stage)")
        if self.variant != "contra" and self.contrastive_steps:
            raise ConfigError(f"np.contrastive_steps={self.contrastive_steps} only applies to np.variant=contra")


@dataclass
class GenerativeEvalConfig:
    """Constrained beam search on the dev sets."""

    num_beams: int = 10  # beams = ranked targets per question
    recall_at: list[int] = field(default_factory=lambda: [1, 5, 10])
    batch_size: int = 32

    def __post_init__(self) -> None:
        check_positive("eval", "num_beams", self.num_beams)
        check_positive("eval", "batch_size", self.batch_size)
        check_recall_at("eval", self.recall_at)
        if max(self.recall_at, default=0) > self.num_beams:
            raise ConfigError(f"eval.recall_at={self.recall_at} asks for more targets than eval.num_beams="
                              f"{self.num_beams} beams return")


@dataclass
class GenerativeConfig:
    """Generative retrieval: question -> identifier, constrained by a trie; vanilla or Np Decoding."""

    data: DataConfig = field(default_factory=DataConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    targets: TargetsConfig = field(default_factory=TargetsConfig)
    np: NpConfig = field(default_factory=NpConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: GenerativeEvalConfig = field(default_factory=GenerativeEvalConfig)
    optimizer: str = "adafactor"  # adafactor (T5's own, lr ~1e-3..1e-2) | adamw

    def __post_init__(self) -> None:
        check_choice("", "optimizer", self.optimizer, ("adafactor", "adamw"))
        if not self.data.toy and not self.data.dev:  # the final evaluation reports on the first dev set
            raise ConfigError("data.toy=false needs data.dev: the final evaluation ranks at least one dev set")
        if not self.np.enabled and (self.np.variant != "base" or self.np.contrastive_steps):
            raise ConfigError(f"np.variant={self.np.variant!r} needs np.enabled=true (vanilla decoding has no CE)")

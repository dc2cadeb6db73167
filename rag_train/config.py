"""Typed run configuration: dataclass schema, YAML files, `key=value` overrides, validation.

Every script takes `--config FILE` plus any number of `section.key=value` overrides. Unknown keys,
wrong types and impossible values are rejected before any work starts, with a message naming the
key (and the file it came from). The resolved config is saved into the run directory.

The schema lives here, in one place: the sections below are shared by both recipes
(`RetrieverTrainConfig` for Algorithm 1, `RLMConfig` for Algorithm 2).
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config that cannot be run; the message names the key and, where known, the file."""


def _choice(section: str, key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{key}={value!r} is not one of {list(allowed)}")


def _absolute(path: Optional[str]) -> Optional[str]:
    """`path` made absolute (symlinks resolved) when it names an existing file or folder, so a saved config
    means the same data from any working directory; anything else (a hub dataset name) is kept as given."""
    return str(Path(path).resolve()) if path and Path(path).exists() else path


def _positive(section: str, key: str, value: Any, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{section}.{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


# ---------------------------------------------------------------------------------------------------
# Shared sections
# ---------------------------------------------------------------------------------------------------


@dataclass
class TinyModelConfig:
    """Shape of a randomly initialised T5 built from a config (tests and the offline toy default)."""

    d_model: int = 64
    d_ff: int = 128
    d_kv: int = 16
    num_heads: int = 4
    num_layers: int = 2
    num_decoder_layers: int = 2

    def __post_init__(self) -> None:
        for key in ("d_model", "d_ff", "d_kv", "num_heads", "num_layers", "num_decoder_layers"):
            _positive("tiny", key, getattr(self, key))


@dataclass
class DataConfig:
    """Where passages and questions come from.

    With `toy: true` (the default) the toy world is generated into `toy_dir` on first use and
    `passages` / `train` / `dev` default to its files. Otherwise name local files (JSONL / DPR TSV /
    MS MARCO / BEIR; parquet or `datasets.save_to_disk` folders for passages and QA sets) or, for QA sets, a
    `datasets` hub name (`nq_open`, `trivia_qa`, `hotpot_qa`). Retriever dev sets may be plain QA files
    (answer recall only).
    """

    toy: bool = True
    toy_dir: str = "data/toy"
    toy_passages: int = 3000
    toy_seed: int = 0
    passages: Optional[str] = None  # JSONL {id,title,text}, DPR / MS MARCO TSV, parquet, or a datasets.save_to_disk folder
    train: Optional[str] = None  # training file (QA JSONL for the RLM, DPR JSON / JSONL for retrieval)
    dev: list[str] = field(default_factory=list)  # evaluation files; metrics are keyed by their stem
    max_train_examples: Optional[int] = None
    max_eval_examples: Optional[int] = None

    def __post_init__(self) -> None:
        _positive("data", "toy_passages", self.toy_passages)
        _positive("data", "max_train_examples", self.max_train_examples)
        _positive("data", "max_eval_examples", self.max_eval_examples)
        if not self.toy and (self.passages is None or self.train is None):
            raise ConfigError("data.toy=false needs data.passages and data.train")
        # absolute paths, so the saved config (and export / evaluate reading it) names the same files anywhere
        self.toy_dir = str(Path(self.toy_dir).resolve())
        self.passages = _absolute(self.passages)
        self.train = ",".join(_absolute(part) or "" for part in self.train.split(",")) if self.train else self.train
        self.dev = [_absolute(path) for path in self.dev]


@dataclass
class RetrieverConfig:
    """Dual encoder f(x), g(y).

    `model`: `tiny` (random init from `tiny`), a Hugging Face encoder id / path, a
    sentence-transformers folder (e.g. `sentence-transformers/gtr-t5-base`: T5 encoder, mean
    pooling, 768->768 projection, L2 normalisation), or a trained retriever's folder (`<run>/retriever`,
    both towers as saved: training continues from a retrieval-pretrained model).
    """

    model: str = "tiny"
    tokenizer: Optional[str] = None  # defaults to the model's own (toy tokenizer for `tiny`)
    pooling: str = "mean"  # mean | cls  (ignored for sentence-transformers folders)
    projection_dim: Optional[int] = None  # linear projection after pooling, GTR style; None = none
    normalize: bool = True
    shared_towers: bool = False  # one encoder for questions and passages
    train_passage_encoder: bool = True  # false = query-side-only training
    max_query_length: int = 32
    max_passage_length: int = 128
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def __post_init__(self) -> None:
        _choice("retriever", "pooling", self.pooling, ("mean", "cls"))
        _positive("retriever", "projection_dim", self.projection_dim)
        _positive("retriever", "max_query_length", self.max_query_length)
        _positive("retriever", "max_passage_length", self.max_passage_length)


@dataclass
class ReaderConfig:
    """Fusion-in-Decoder reader over `T5ForConditionalGeneration`."""

    model: str = "tiny"  # tiny | google/t5-base-lm-adapt | local path
    tokenizer: Optional[str] = None
    max_input_length: int = 256  # tokens of "question: .. title: .. context: .." per passage
    max_answer_length: int = 16
    gradient_checkpointing: bool = False
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def __post_init__(self) -> None:
        _positive("reader", "max_input_length", self.max_input_length)
        _positive("reader", "max_answer_length", self.max_answer_length)


@dataclass
class CorrectorConfig:
    """h(b) = b + W2 relu(W1 b + c1) + c2, W2 = 0 at init (seed 000)."""

    hidden: int = 8192
    loss: str = "ce"  # ce (Eq. 6, preferred) | mse (Eq. 5)
    weight: float = 10.0
    lr: float = 1e-4
    # Algorithm 2: h trains on the top-`candidates` of its own ranking (fresh g(y) for them, no gradient); the
    # reader and perplexity distillation still read the top strategy.top_k. 0 = top_k (the paper, k = 32). A
    # small k shows h too little of the ranking to learn which passages the moving retriever now ranks high.
    candidates: int = 0
    # divergence guard: a step whose (weighted) corrector loss is above this skips the corrector's update and
    # keeps the encoder's (0 = off; a non-finite corrector loss or gradient always skips it). See
    # train.common.optimizer_step; train.max_bad_steps such steps in a row stop the run.
    max_loss: float = 0.0

    def __post_init__(self) -> None:
        _positive("strategy.corrector", "hidden", self.hidden)
        _choice("strategy.corrector", "loss", self.loss, ("ce", "mse"))
        _positive("strategy.corrector", "weight", self.weight, allow_zero=True)
        _positive("strategy.corrector", "lr", self.lr)
        _positive("strategy.corrector", "max_loss", self.max_loss, allow_zero=True)
        _positive("strategy.corrector", "candidates", self.candidates, allow_zero=True)


@dataclass
class BufferConfig:
    """The stale embedding buffer and how it is searched."""

    path: Optional[str] = None  # reuse this buffer dir (manifest decides if it matches); default: run_dir/buffer
    dtype: str = "float16"  # on-disk dtype
    shard_rows: int = 1_000_000
    # corpus embedding (buffer build, exhaustive refresh, evaluation, export: rag_train/buffer/embed.py)
    embed_batch_size: int = 256  # passages per batch, at most
    embed_batch_tokens: int = 0  # padded tokens per batch, at most (0: embed_batch_size x max_passage_length)
    # DataLoader worker processes that read and tokenise passages while the model encodes (0: in the main
    # process). On a GPU host give it several cores (e.g. 8); on a 2-core CPU host 1 (docs/embed_benchmark.md)
    embed_workers: int = 1
    search: str = "corrector_full"  # exact | corrector_full | corrector_rerank
    chunk_rows: int = 65536  # rows scored per chunk: peak extra memory O(chunk x (hidden + k))
    faiss_index: str = "Flat"  # candidate index for corrector_rerank: Flat | IVF{n},Flat | HNSW{m} | any factory string
    rerank_candidates: int = 1024
    device: str = "auto"  # where the buffer is searched: auto | cpu | cuda
    # before training, check every shard's sha256 against the manifest (each process hashes 1/N of them);
    # false skips it for huge buffers on trusted storage (a truncated shard is still caught by its size)
    verify: bool = True

    def __post_init__(self) -> None:
        self.path = str(Path(self.path).resolve()) if self.path else self.path  # see DataConfig
        _choice("buffer", "dtype", self.dtype, ("float16", "bfloat16", "float32"))
        _choice("buffer", "search", self.search, ("exact", "corrector_full", "corrector_rerank"))
        for key in ("shard_rows", "embed_batch_size", "chunk_rows", "rerank_candidates"):
            _positive("buffer", key, getattr(self, key))
        for key in ("embed_batch_tokens", "embed_workers"):
            _positive("buffer", key, getattr(self, key), allow_zero=True)


STRATEGIES = ("in_batch", "uniform", "stale", "exhaustive", "snm", "negative_cache", "corrector", "frozen", "closed_book")


@dataclass
class StrategyConfig:
    """How the passage subset S_x is chosen (one implementation per name, same interface)."""

    name: str = "corrector"
    top_k: int = 64  # passages retrieved (Alg. 1: shared top-64; Alg. 2: per-question top-32)
    uniform_negatives: int = 64  # Alg. 1 only: uniform targets added to the shared subset
    sampling: str = "topk"  # topk | gumbel (Gumbel-max samples without replacement instead of top-k)
    refresh_every: int = 500  # exhaustive / snm: re-embed every R steps
    snm_targets: int = 1_000_000  # snm: size M of the re-sampled, re-embedded subset
    cache_size: int = 65536  # negative_cache: streaming cache size (alpha * m)
    cache_refresh: int = 256  # negative_cache: entries evicted / inserted per step
    corrector: CorrectorConfig = field(default_factory=CorrectorConfig)

    def __post_init__(self) -> None:
        _choice("strategy", "name", self.name, STRATEGIES)
        _choice("strategy", "sampling", self.sampling, ("topk", "gumbel"))
        _positive("strategy", "top_k", self.top_k)
        _positive("strategy", "uniform_negatives", self.uniform_negatives, allow_zero=True)
        for key in ("refresh_every", "snm_targets", "cache_size", "cache_refresh"):
            _positive("strategy", key, getattr(self, key))


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping shared by both recipes."""

    output_dir: str = "runs/default"
    steps: int = 1000
    batch_size: int = 16  # global batch (split across processes)
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # beta = 1 / temperature on retriever scores
    seed: int = 0
    mixed_precision: str = "no"  # no | bf16 | fp16 (passed to accelerate)
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    save_every: int = 0  # 0 = only at the end
    resume: bool = False  # continue from the newest complete checkpoint in output_dir (checksums verified)
    # steps skipped in a row (non-finite loss / gradient, or a diverged corrector) before the run stops
    max_bad_steps: int = 10
    # seconds any collective (all-reduce, barrier, gather) may wait for the other processes: a hung process
    # then stops the run with a timeout error instead of a silent hang (a dead one stops it at once)
    collective_timeout: int = 1800
    tracker: Optional[str] = "tensorboard"  # any accelerate tracker name, or None

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "lr", "temperature", "log_every", "max_bad_steps", "collective_timeout"):
            _positive("train", key, getattr(self, key))
        for key in ("warmup_steps", "eval_every", "save_every", "weight_decay", "max_grad_norm"):
            _positive("train", key, getattr(self, key), allow_zero=True)
        _choice("train", "mixed_precision", self.mixed_precision, ("no", "bf16", "fp16"))


@dataclass
class BatchingConfig:
    """How Algorithm 1 turns one optimizer step's global batch into a gradient under a memory cap (seed 002).

    `name` picks one option of `rag_train/train/batching/` (each one file; it says which keys it reads and
    which strategies it takes, checked before any work):
      plain      — the whole batch in one forward (K = 1, no bank): the in-batch / subset softmax of seed 000;
      grad_accum — K micro-batches, each one's loss over its own passages only, averaged (not the big batch's
                   gradient: fewer negatives per query);
      grad_cache — representations of all K chunks without gradient, the full-batch loss on them, its gradient
                   per representation cached, each chunk re-encoded with gradient: exactly the full-batch gradient;
      cont_accum — K micro-batches plus FIFO banks of past query / positive / hard-negative vectors that join
                   each micro-batch's softmax as rows and columns (banked queries are loss rows).
    `train.batch_size` stays the global batch of one optimizer step (N_total); each micro-batch holds
    batch_size / micro_batches of it (N_local x processes).
    """

    name: str = "plain"
    micro_batches: int = 1  # K: micro-batches per optimizer step (grad_accum, grad_cache, cont_accum)
    bank_size: int = 0  # M: cont_accum's bank capacity, in training triples (0 = no bank: grad_accum's loss)
    # cont_accum: banked queries are loss rows with their banked positives (the paper); false = a passage-only bank
    # (pre-batch negatives, the paper's ablation without M_q: the passage tower's gradient then dwarfs the query's)
    bank_queries: bool = True
    # cont_accum: bank, per banked query, its hardest non-positive passage of the subset (seed 002's M_h); a query
    # whose subset has none (in_batch without extra negatives) leaves its slot empty (masked)
    bank_hard_negatives: bool = True
    # cont_accum: a column holding the row's own positive passage (same corpus row) that is not its label column
    # is left out of that row's softmax (the paper does not mask; duplicates then count as negatives)
    mask_false_negatives: bool = False
    # CUDA: torch.cuda.set_per_process_memory_fraction (an explicit cap: exceeding it is an OOM); 0 = no cap.
    # Peak memory per step is logged either way (CUDA: max allocated; CPU: the process's peak RSS).
    memory_fraction: float = 0.0

    def __post_init__(self) -> None:
        _positive("batching", "micro_batches", self.micro_batches)
        _positive("batching", "bank_size", self.bank_size, allow_zero=True)
        if not 0 <= self.memory_fraction <= 1:
            raise ConfigError(f"batching.memory_fraction={self.memory_fraction} must be in [0, 1] (0 = no cap)")


@dataclass
class EvalConfig:
    batch_size: int = 64
    recall_at: list[int] = field(default_factory=lambda: [1, 5, 10, 20, 100])
    num_passages: Optional[int] = None  # RLM: passages given to the reader at eval (default strategy.top_k)
    # Evaluations DURING training (train.eval_every) embed the corpus afresh only up to this many rows; a larger
    # corpus is ranked over the stale buffer instead (no corpus pass; a strategy without a buffer embeds afresh).
    # The final evaluation always embeds afresh (exact). 0: always over the buffer (docs/scale.md).
    fresh_rows: int = 1_000_000

    def __post_init__(self) -> None:
        _positive("eval", "batch_size", self.batch_size)
        _positive("eval", "fresh_rows", self.fresh_rows, allow_zero=True)
        for k in self.recall_at:
            _positive("eval", "recall_at", k)


# ---------------------------------------------------------------------------------------------------
# Recipe schemas
# ---------------------------------------------------------------------------------------------------


FINE_TUNING_MAX_LR = 1e-4  # above this, AdamW steps wreck a pretrained encoder within a few steps


def warn_if_lr_wrecks_pretrained(retriever: RetrieverConfig, key: str, lr: float) -> None:
    """Warn when a pretrained retriever (anything but `tiny`) is to be trained at a from-scratch learning rate."""
    if retriever.model != "tiny" and lr > FINE_TUNING_MAX_LR:
        warnings.warn(
            f"retriever.model={retriever.model!r} is a pretrained checkpoint, and {key}={lr:g} is far above the "
            f"rates pretrained encoders are fine-tuned at (1e-5 to 5e-5 with AdamW; > {FINE_TUNING_MAX_LR:g} here "
            f"warns): a few such steps can undo the pretraining. Lower {key} (see configs/retriever/toy_minilm_finetune.yaml).",
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
        warn_if_lr_wrecks_pretrained(self.retriever, "train.lr", self.train.lr)


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
    retriever_lr: float = 1e-3
    retriever_batch_size: int = 32
    retriever_train: Optional[str] = None  # DPR-format file; default: the toy world's retrieval-train
    # reuse the warm-start outputs of an earlier run (its warm_start_retriever/ and warm_start_reader/), so
    # that baselines (frozen, closed book, ...) start from exactly the same models
    from_run: Optional[str] = None

    def __post_init__(self) -> None:
        _positive("warm_start", "reader_steps", self.reader_steps, allow_zero=True)
        _positive("warm_start", "retriever_steps", self.retriever_steps, allow_zero=True)
        _positive("warm_start", "reader_lr", self.reader_lr)
        _positive("warm_start", "reader_passages", self.reader_passages)
        _positive("warm_start", "reader_copy_steps", self.reader_copy_steps, allow_zero=True)
        _positive("warm_start", "reader_batch_size", self.reader_batch_size)
        _positive("warm_start", "retriever_lr", self.retriever_lr)
        _choice("warm_start", "retriever_strategy", self.retriever_strategy, ("in_batch", "uniform", "stale"))
        _choice("warm_start", "reader_distractors", self.reader_distractors, ("random", "retrieved"))
        self.retriever_train = _absolute(self.retriever_train)  # see DataConfig
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
    # lr of the retriever's parameters (null = train.lr); Atlas keeps a separate retriever lr. Slower
    # retriever drift is easier for the corrector to track from stale vectors.
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
        _positive("", "reader_temperature", self.reader_temperature)
        warn_if_lr_wrecks_pretrained(self.retriever, "retriever_lr" if self.retriever_lr else "train.lr",
                                     self.retriever_lr or self.train.lr)
        if self.warm_start.retriever_steps:
            warn_if_lr_wrecks_pretrained(self.retriever, "warm_start.retriever_lr", self.warm_start.retriever_lr)
        if self.retriever_lr is not None:
            _positive("", "retriever_lr", self.retriever_lr)
        _positive("", "retriever_start_step", self.retriever_start_step, allow_zero=True)
        _positive("", "min_embedding_spread", self.min_embedding_spread, allow_zero=True)
        if not 0 <= self.pdist_gate < 1:
            raise ConfigError(f"pdist_gate={self.pdist_gate} must be in [0, 1)")
        if self.strategy.name in ("in_batch", "negative_cache"):
            raise ConfigError(f"strategy.name={self.strategy.name!r} proposes no per-question passages; the RLM "
                              "takes corrector, stale, frozen, exhaustive, snm, uniform or closed_book")


@dataclass
class EmbedConfig:
    """scripts/embed_corpus.py: embed a corpus once into a stale buffer (multi-process, resumable).

    The buffer goes to `output` (default `buffer.path`); rerunning the same command resumes a killed
    build. Embeds with a saved DualEncoder (`model_dir`) or with `retriever` built from its config.
    """

    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    passages: Optional[str] = None  # corpus to embed; default data.passages or the toy world's
    output: Optional[str] = None  # buffer directory; default buffer.path
    model_dir: Optional[str] = None  # a DualEncoder.save folder (e.g. a trained retriever)
    seed: int = 0  # init seed of `tiny` models: equal to the training run's so its buffer matches
    overwrite: bool = False  # replace a complete buffer of another model / corpus in `output`
    collective_timeout: int = 1800  # seconds a collective waits for the other processes (see train.collective_timeout)

    def __post_init__(self) -> None:
        _positive("", "collective_timeout", self.collective_timeout)
        if self.output is None and self.buffer.path is None:
            raise ConfigError("embed: set output=DIR (or buffer.path=DIR) for the buffer")


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------

T = TypeVar("T")


def _explain(exc: OmegaConfBaseException, origin: str) -> str:
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0]
    if "not in" in msg or "Key '" in msg and "not" in msg:
        return f"{origin}: unknown config key '{key}'"
    return f"{origin}: bad value for config key '{key}': {msg}"


def load_config(schema: type[T], path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> T:
    """Build a `schema` instance from defaults <- YAML file <- `key=value` overrides, validated."""
    merged = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            from_file = OmegaConf.load(path)
        except Exception as exc:  # yaml syntax errors carry line numbers in their text
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        try:
            merged = OmegaConf.merge(merged, from_file)
        except OmegaConfBaseException as exc:
            raise ConfigError(_explain(exc, str(path))) from exc
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"command-line override {item!r} is not of the form key=value")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise ConfigError(_explain(exc, f"override {item!r}")) from exc
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, str(path or "config"))) from exc


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config (atomically) so a run can be reproduced from its directory alone."""
    from rag_train.io import atomic_write_text

    atomic_write_text(Path(path), to_yaml(cfg))


INPUT_FAULT_EXIT = 2  # bad config, data, buffer, checkpoint or model path
NUMERICAL_FAULT_EXIT = 3  # the run stopped after too many non-finite / diverged steps
PEER_FAULT_EXIT = 4  # a collective failed: another process died, or hung past the collective timeout
_PEER_FAILURE = ("Timed out", "timed out", "Connection reset by peer", "Connection closed by peer", "Broken pipe")


@contextmanager
def exit_on_fault() -> Iterator[None]:
    """For entry scripts: a known fault ends the process with `error: <message>` on stderr (the message names
    the file, line, field or key) and a non-zero status, without a traceback; anything else propagates."""
    from rag_train.buffer.store import BufferError
    from rag_train.data.errors import DataError
    from rag_train.io import CorruptFileError
    from rag_train.models.reader import ReaderLoadError

    prefix = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    try:
        yield
    except (ConfigError, DataError, BufferError, CorruptFileError, ReaderLoadError) as exc:
        print(f"{prefix}error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(INPUT_FAULT_EXIT) from exc
    except FloatingPointError as exc:
        print(f"{prefix}error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(NUMERICAL_FAULT_EXIT) from exc
    except RuntimeError as exc:  # torch.distributed reports a dead / hung peer as a RuntimeError from gloo / NCCL
        text = str(exc)
        if not any(marker in text for marker in _PEER_FAILURE):
            raise
        print(f"{prefix}error: a collective operation with the other processes failed: another process died, or hung "
              f"longer than train.collective_timeout; stopping. The last checkpoint is intact (train.resume=true "
              f"continues from it). Cause: {text.splitlines()[0][:300]}", file=sys.stderr, flush=True)
        raise SystemExit(PEER_FAULT_EXIT) from exc


def parse_cli(schema: type[T], argv: Optional[list[str]] = None, description: str = "",
              default_config: Optional[str | Path] = None) -> T:
    """`script.py [--config FILE] [key=value ...]`; on a bad config print the reason and exit 2."""
    import argparse

    parser = argparse.ArgumentParser(description=description or schema.__doc__)
    parser.add_argument("--config", default=default_config, help=f"YAML config file (default: {default_config})")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    try:
        return load_config(schema, args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(INPUT_FAULT_EXIT) from exc

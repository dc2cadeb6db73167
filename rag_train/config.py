"""Typed run configuration: dataclass schema, YAML files, `key=value` overrides, validation.

Every script takes `--config FILE` plus any number of `section.key=value` overrides. Unknown keys,
wrong types and impossible values are rejected before any work starts, with a message naming the
key (and the file it came from). The resolved config is saved into the run directory.

The sections below are shared by both recipes; the recipes' schemas (`RetrieverTrainConfig` for
Algorithm 1, `RLMConfig` for Algorithm 2, in `rag_train.train.schema`) add the `strategy` and `batching`
sections, whose keys each strategy or batching module declares (`plugin_section`: `rag_train.strategies`,
`rag_train.train.batching`). This module is the bottom layer: it knows no models,
buffers, strategies or command line.

Long file: the shared sections and the loader that validates them are one schema; the loader's messages name
the sections' keys, and a section moved elsewhere would import the loader back.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config that cannot be run; the message names the key and, where known, the file."""


def check_choice(section: str, key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{key}={value!r} is not one of {list(allowed)}")


def absolute_path(path: Optional[str]) -> Optional[str]:
    """`path` made absolute (symlinks resolved) when it names an existing file or folder, so a saved config
    means the same data from any working directory; anything else (a hub dataset name) is kept as given."""
    return str(Path(path).resolve()) if path and Path(path).exists() else path


def check_positive(section: str, key: str, value: Any, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison below
        raise ConfigError(f"{section}.{key}={value!r} must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{section}.{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def check_recall_at(section: str, ks: list[int]) -> None:
    """The depths the final evaluation reports: checked here, since a bad one would only fail after training."""
    if not ks:
        raise ConfigError(f"{section}.recall_at=[] is empty: the final evaluation reports recall at these depths; "
                          "give at least one, e.g. [1, 5, 10]")
    for k in ks:
        check_positive(section, "recall_at", k)


def _field_default(spec: dataclasses.Field) -> Any:
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def plugin_section(section: str, base: type, plugins: dict[str, type], header: str,
                   namespace: Optional[dict] = None) -> tuple[type, dict[str, tuple[str, ...]]]:
    """The config section of alternatives that plug in by one file each (strategies, batching options).

    `plugins` maps each alternative's name to its class, whose `config` is its own config dataclass, a subclass of
    `base` (whose keys every alternative reads). The section holds `base`'s keys and every alternative's own keys,
    each spelled `<section>.<key>`; a key several alternatives declare (`strategy.refresh_every`) is one key, so they
    must agree on its type and default. The section validates `name`, and `selected()` builds the chosen
    alternative's own config (its checks run); `unread_keys()` names the keys the chosen one does not read, and
    `load_config` refuses a command-line override of one. Returns the section class and, per own key, the
    alternatives that read it."""
    common = {spec.name for spec in dataclasses.fields(base)}
    found: dict[str, tuple[Any, dataclasses.Field, str]] = {}
    owners: dict[str, list[str]] = {}
    configs = {name: plugin.config for name, plugin in plugins.items()}
    for name, own in [("", base), *configs.items()]:
        if not (dataclasses.is_dataclass(own) and issubclass(own, base)):
            raise TypeError(f"{section} {name!r}: its config must be a dataclass subclassing {base.__name__}")
        types = typing.get_type_hints(own)
        for spec in dataclasses.fields(own):
            if spec.name not in common:
                owners.setdefault(spec.name, []).append(name)
            if spec.name not in found:
                found[spec.name] = (types[spec.name], spec, name)
                continue
            kind, first, first_owner = found[spec.name]
            if kind != types[spec.name] or _field_default(first) != _field_default(spec):
                raise TypeError(f"{section} key {spec.name!r} is declared differently by {first_owner!r} and "
                                f"{name!r} (type or default): alternatives that share a key must agree on it")
    fields = [(key, kind, dataclasses.field(default_factory=spec.default_factory)
               if spec.default_factory is not dataclasses.MISSING else dataclasses.field(default=spec.default))
              for key, (kind, spec, _) in found.items()]
    owners_of = {key: tuple(names) for key, names in owners.items()}

    def selected(self):
        own = configs[self.name]
        return own(**{spec.name: getattr(self, spec.name) for spec in dataclasses.fields(own)})

    def check(self) -> None:
        check_choice(section, "name", self.name, tuple(plugins))
        self.selected()

    def unread_keys(self) -> dict[str, str]:
        reads = {spec.name for spec in dataclasses.fields(configs[self.name])}
        return {key: f"{section} {self.name!r} does not read {section}.{key} (a key of {', '.join(names)})"
                for key, names in owners_of.items() if key not in reads}

    lines = [header,
             f"`{section}.name` picks one; each reads the common keys ({', '.join(sorted(common))}) and its own:"]
    for name, plugin in plugins.items():
        keys = [spec.name for spec in dataclasses.fields(plugin.config) if spec.name not in common]
        lines.append(f"  {name}: {', '.join(keys) or '-'}  ({plugin.__module__})")
    methods = {"__post_init__": check, "selected": selected, "unread_keys": unread_keys, "__doc__": "\n".join(lines),
               "__module__": (namespace or {}).get("__module__", __name__)}
    cls = dataclasses.make_dataclass(f"{section.capitalize()}Config", fields,
                                     namespace={**methods, **(namespace or {})})
    return cls, owners_of


def _device(section: str, key: str, value: str) -> None:
    """`auto`, `cpu` or a CUDA device that exists here (checked before any work, not at the first search)."""
    if value == "auto":
        return
    import torch

    try:
        device = torch.device(value)
    except RuntimeError as exc:
        raise ConfigError(f"{section}.{key}={value!r} is not a device (auto | cpu | cuda | cuda:N)") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{section}.{key}={value!r} is not one of auto | cpu | cuda | cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{section}.{key}={value!r} but CUDA is not available on this machine; use auto or cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{section}.{key}={value!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")


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
            check_positive("tiny", key, getattr(self, key))


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
    # replace a complete toy world of other parameters (seed, passages, version) in toy_dir; without it that is
    # refused, since runs, buffers and exports made from the old world would silently stop matching it
    toy_regenerate: bool = False
    # what the toy world's retrieval files (Algorithm 1) ask: `named` (nq + tqa questions, which name their person in
    # full; a retriever learns to copy the name and saturates near R@1 100) or `described` (the person named by first
    # name and another fact, matched by meaning among near-duplicates; R@1 stays well below 100; docs/toy_world.md)
    toy_retrieval: str = "named"
    # JSONL {id,title,text}, DPR / MS MARCO TSV, parquet, or a datasets.save_to_disk folder
    passages: Optional[str] = None
    train: Optional[str] = None  # training file (QA JSONL for the RLM, DPR JSON / JSONL for retrieval)
    dev: list[str] = field(default_factory=list)  # evaluation files; metrics are keyed by their stem
    max_train_examples: Optional[int] = None
    max_eval_examples: Optional[int] = None
    # QA answers that normalise to nothing or to punctuation only ("The", "a", "—"): an empty prediction would score
    # EM 1 against them. warn: keep them, say how many and which; drop: remove them (and questions left without an
    # answer), saying so; error: refuse the file
    empty_answers: str = "warn"

    def __post_init__(self) -> None:
        check_choice("data", "empty_answers", self.empty_answers, ("warn", "drop", "error"))
        check_choice("data", "toy_retrieval", self.toy_retrieval, ("named", "described"))
        check_positive("data", "toy_passages", self.toy_passages)
        check_positive("data", "toy_seed", self.toy_seed, allow_zero=True)
        check_positive("data", "max_train_examples", self.max_train_examples)
        check_positive("data", "max_eval_examples", self.max_eval_examples)
        if not self.toy and (self.passages is None or self.train is None):
            raise ConfigError("data.toy=false needs data.passages and data.train")
        # absolute paths, so the saved config (and export / evaluate reading it) names the same files anywhere
        self.toy_dir = str(Path(self.toy_dir).resolve())
        self.passages = absolute_path(self.passages)
        self.train = ",".join(absolute_path(part) or "" for part in self.train.split(",")) if self.train else self.train
        self.dev = [absolute_path(path) for path in self.dev]


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
    # the towers' T5 attention (rag_train/models/attention.py): auto = the kernels measured fastest (eager corpus
    # passes; training eager on CPU, SDPA on CUDA); flex = FlexAttention for the corpus pass and training (CUDA only,
    # towers without dropout; its GPU speed not measured yet); eager = eager everywhere
    encoder_kernel: str = "auto"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def __post_init__(self) -> None:
        check_choice("retriever", "pooling", self.pooling, ("mean", "cls"))
        check_choice("retriever", "encoder_kernel", self.encoder_kernel, ("auto", "eager", "flex"))
        check_positive("retriever", "projection_dim", self.projection_dim)
        check_positive("retriever", "max_query_length", self.max_query_length)
        check_positive("retriever", "max_passage_length", self.max_passage_length)


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
        check_positive("reader", "max_input_length", self.max_input_length)
        check_positive("reader", "max_answer_length", self.max_answer_length)


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
    # process). On a GPU host give it several cores (e.g. 8); on a 2-core CPU host 1 (docs/embed_benchmark.md).
    # The token cache's build, where this process only waits, uses them from 2 up (1: tokenised here)
    embed_workers: int = 1
    # tokenise the corpus once into a token cache (`<buffer folder>.tokens`, buffer/tokens.py) that every later
    # corpus pass reads instead of tokenising again (the same vectors); false: every pass tokenises
    token_cache: bool = True
    # how a strategy with an index searches it: `full` scores every row (<q, b>, or <q, h(b)> through the
    # corrector); `rerank` re-scores the same way only FAISS candidates, for a never-refreshed buffer that does not
    # fit device memory (stale, frozen, corrector; each strategy declares what it supports)
    search: str = "full"
    chunk_rows: int = 65536  # rows scored per chunk: peak extra memory O(chunk x (hidden + k))
    # `full` through the corrector: score each chunk with one torch.compile'd function (search's `fused`; the first
    # search compiles it, max-autotune on CUDA); the same rows. Off until a GPU session measures it faster
    # (docs/generated/gpu_report.md); on 2 CPU cores it is level with the unfused scan (docs/search_benchmark.md)
    fused_search: bool = False
    faiss_index: str = "Flat"  # candidate index for `rerank`: Flat | IVF{n},Flat | HNSW{m} | any factory string
    rerank_candidates: int = 1024
    device: str = "auto"  # where the buffer is searched: auto | cpu | cuda
    # before training, check every shard's sha256 against the manifest (each process hashes 1/N of them);
    # false skips it for huge buffers on trusted storage (a truncated shard is still caught by its size)
    verify: bool = True

    def __post_init__(self) -> None:
        self.path = str(Path(self.path).resolve()) if self.path else self.path  # see DataConfig
        check_choice("buffer", "dtype", self.dtype, ("float16", "bfloat16", "float32"))
        check_choice("buffer", "search", self.search, ("full", "rerank"))
        for key in ("shard_rows", "embed_batch_size", "chunk_rows", "rerank_candidates"):
            check_positive("buffer", key, getattr(self, key))
        _device("buffer", "device", self.device)
        for key in ("embed_batch_tokens", "embed_workers"):
            check_positive("buffer", key, getattr(self, key), allow_zero=True)


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
    # checkpoints kept, newest first (0 = every one): more than the 2 a resume needs let a diagnostic look back
    # over training (scripts/diagnose_retriever.py --checkpoints)
    keep_checkpoints: int = 2
    # continue the run in output_dir from its newest complete checkpoint (checksums verified); refused if the
    # config changes the computation (only train.steps, eval / log / save cadence, tracker, timeouts and the eval.*
    # keys may change). SIGTERM / SIGUSR1 stop a run after its current step with a checkpoint (exit status 6)
    resume: bool = False
    # replace a finished or partial run in output_dir (its config, checkpoints, metrics, saved models, logs and
    # warm-start stages are deleted first; its buffer is reused only if it matches). Without resume or overwrite,
    # a directory that already holds a run is refused.
    overwrite: bool = False
    # steps skipped in a row (non-finite loss / gradient, or a diverged corrector) before the run stops
    max_bad_steps: int = 10
    # seconds any collective (all-reduce, barrier, gather) may wait for the other processes: a hung process
    # then stops the run with a timeout error instead of a silent hang (a dead one stops it at once)
    collective_timeout: int = 1800
    tracker: Optional[str] = "tensorboard"  # any accelerate tracker name, or None
    # torch threads of each CPU process: `auto` = the cores this process may use (os.sched_getaffinity) divided
    # by the processes on the machine, unless OMP_NUM_THREADS or `accelerate launch --num_cpu_threads_per_process`
    # asks for a count (accelerate launch's own OMP_NUM_THREADS=1 default is not a request); N = N threads.
    # GPU processes keep the launcher's setting (rag_train/launch.py)
    cpu_threads: str = "auto"

    def __post_init__(self) -> None:
        if self.cpu_threads != "auto" and not (self.cpu_threads.isdigit() and int(self.cpu_threads) > 0):
            raise ConfigError(f"train.cpu_threads={self.cpu_threads!r} must be auto or a positive number of threads")
        for key in ("steps", "batch_size", "lr", "temperature", "log_every", "max_bad_steps", "collective_timeout"):
            check_positive("train", key, getattr(self, key))
        for key in ("warmup_steps", "eval_every", "save_every", "keep_checkpoints", "weight_decay", "max_grad_norm",
                    "seed"):
            check_positive("train", key, getattr(self, key), allow_zero=True)
        check_choice("train", "mixed_precision", self.mixed_precision, ("no", "bf16", "fp16"))


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
        check_positive("eval", "batch_size", self.batch_size)
        check_positive("eval", "fresh_rows", self.fresh_rows, allow_zero=True)
        check_positive("eval", "num_passages", self.num_passages)
        check_recall_at("eval", self.recall_at)


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
        if not isinstance(from_file, DictConfig):  # a YAML list or scalar at the top level
            raise ConfigError(f"{path}: the top level is a YAML list, not a mapping of sections (data:, train:, ...)")
        try:
            merged = OmegaConf.merge(merged, from_file)
        except OmegaConfBaseException as exc:
            raise ConfigError(_explain(exc, str(path))) from exc
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"command-line override {item!r} is not of the form key=value")
    if overrides:
        # one merge of every override in order (one copy of the config, not one per override: with 25 overrides
        # the copies were a third of a short run); on failure, merged one at a time to name the override at fault
        try:
            merged = OmegaConf.merge(merged, *(OmegaConf.from_dotlist([item]) for item in overrides))
        except OmegaConfBaseException as exc:
            for item in overrides:
                try:
                    merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
                except OmegaConfBaseException as one:
                    raise ConfigError(_explain(one, f"override {item!r}")) from one
            raise ConfigError(_explain(exc, "command-line overrides")) from exc
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, str(path or "config"))) from exc
    for item in overrides or []:
        _refuse_if_unread(cfg, item)
    return cfg


def _refuse_if_unread(cfg: Any, item: str) -> None:
    """ConfigError for a `key=value` override that the resolved config does not read: a section of alternatives
    (`plugin_section`: strategy, batching) says which of its keys the chosen one ignores through `unread_keys()`.
    A YAML file may set them all on purpose (to switch by `name` alone); on the command line one is a mistake."""
    node = cfg
    for part in item.split("=", 1)[0].split("."):
        unread = getattr(node, "unread_keys", None)
        if unread is not None and part in unread():
            raise ConfigError(f"override {item!r}: {unread()[part]}")
        node = getattr(node, part, None)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-4}} -> {"train.lr": 1e-4}: nested sections become dotted keys, the spelling of
    overrides (lists and other non-dict values are kept as they are)."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | Path, text: Optional[str] = None) -> None:
    """Write the resolved config (atomically) so a run can be reproduced from its directory alone; `text`: its
    `to_yaml`, where the caller has it already."""
    from rag_train.io import atomic_write_text

    atomic_write_text(Path(path), to_yaml(cfg) if text is None else text)

"""What every option of `batching` shares: the keys every option reads (`BaseBatchingConfig`), the interface
(`BatchingOption`), its registration (`@register`, into `REGISTRY`), and the pieces of Algorithm 1's step (seed 000)
that the options arrange differently.

An option is one module of this package: a `BatchingOption` subclass decorated with `@register`, declaring its `name`,
its own config dataclass (`config`, a `BaseBatchingConfig` subclass whose fields are the `batching.<key>` keys it
reads, validated in `__post_init__`) and what it refuses (`check`). `rag_train.train.batching` imports every module of
the package (`rag_train.plugins.Registry.discover`, as the strategies do), so the registry and the config section
follow from these declarations.

One optimizer step of Algorithm 1 takes the global batch as K micro-batches (K = 1 for `plain`), each a
contiguous 1/K of the global batch of which every process holds its 1/N share, so the split does not depend on
the number of processes. An option turns them into gradients in `.grad` (or returns the loss for the recipe's
`optimizer_step` to back-propagate) and may keep state across steps (ContAccum's banks), checkpointed here.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
from safetensors.torch import load_file, save_file

from rag_train.config import ConfigError, check_positive
from rag_train.io import atomic_write_json
from rag_train.losses import retrieval_scores
from rag_train.plugins import Registry
from rag_train.strategies.base import Strategy, Subset
from rag_train.train.passages import gather_with_grad, my_share


@dataclass
class MicroBatch:
    questions: list[str]
    positives: torch.Tensor  # [n_local] corpus row of each question's positive


@dataclass
class StepParts:
    """What an option may use: the prepared module (`Trainable`, whose forward runs what has a gradient), the
    unwrapped retriever, the strategy proposing each subset, the corpus, the accelerator."""

    accelerator: Any
    trainable: torch.nn.Module
    model: torch.nn.Module  # rag_train.models.retriever.DualEncoder, unwrapped
    strategy: Strategy
    corpus: Any
    temperature: float


@dataclass
class StepResult:
    loss: torch.Tensor  # the task loss of the step (mean over micro-batches); with a graph unless backward_done
    aux: Optional[torch.Tensor]  # the strategy's auxiliary (corrector) loss, same convention
    backward_done: bool  # True: gradients are already in .grad
    columns: float  # passages in each softmax (mean over micro-batches)
    logged: dict[str, float] = field(default_factory=dict)


@dataclass
class BaseBatchingConfig:
    """The `batching` keys every option reads. How Algorithm 1 turns one optimizer step's global batch into a
    gradient under a memory cap (seed 002) is `name`: one option of `rag_train/train/batching/`, each one file
    declaring its own keys (a subclass of this); the section is built from them (`rag_train.config.plugin_section`).
    `train.batch_size` stays the global batch of one optimizer step (N_total)."""

    name: str = "plain"
    # CUDA: torch.cuda.set_per_process_memory_fraction (an explicit cap: exceeding it is an OOM); 0 = no cap.
    # Peak memory per step is logged either way (CUDA: max allocated; CPU: the process's peak RSS).
    memory_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.memory_fraction <= 1:
            raise ConfigError(f"batching.memory_fraction={self.memory_fraction} must be in [0, 1] (0 = no cap)")


@dataclass
class MicroBatchesConfig(BaseBatchingConfig):
    """The key of the options that split the global batch: each micro-batch holds batch_size / micro_batches of
    it (N_local x processes)."""

    micro_batches: int = 1  # K: micro-batches per optimizer step

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("batching", "micro_batches", self.micro_batches)


class BatchingOption:
    """One way to make Algorithm 1's gradient from the micro-batches of a step. A registered subclass
    (`@register`) sets `name` (the value of `batching.name`) and `config` (its own config dataclass: the
    `batching.*` keys it reads; a key only other options read must keep its default), and refuses in `check` what
    it cannot run. The class docstring is the option's line in the `batching` section's documentation."""

    name: ClassVar[str] = ""
    config: ClassVar[type[BaseBatchingConfig]] = BaseBatchingConfig
    own_backward: ClassVar[bool] = True  # runs its backward passes itself (not under DeepSpeed, which steps in each)
    min_micro_batches: ClassVar[int] = 1  # the fewest `batching.micro_batches` it runs with (checked before any work)

    def __init__(self, cfg: BaseBatchingConfig, parts: StepParts):
        self.cfg = cfg
        self.parts = parts

    @classmethod
    def check(cls, cfg: BaseBatchingConfig, strategy: type[Strategy], world: int) -> None:
        """ConfigError for a combination this option cannot run (called before any work)."""

    def step(self, micro_batches: list[MicroBatch]) -> StepResult:
        raise NotImplementedError

    # -- state (none by default; ContAccum's banks) ---------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def save(self, directory: Path) -> None:
        """This process's option state into a checkpoint folder (nothing for stateless options)."""
        tensors = self.state_tensors()
        if not tensors:
            return
        rank = self.parts.accelerator.process_index
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                  str(directory / f"batching-rank{rank}.safetensors"))
        atomic_write_json(directory / f"batching-rank{rank}.json", {"name": self.name})

    def load(self, directory: Path) -> None:
        rank = self.parts.accelerator.process_index
        path = directory / f"batching-rank{rank}.safetensors"
        if not self.state_tensors():
            return
        if not path.is_file():
            raise ConfigError(f"{directory} holds no state of batching.name={self.name!r} ({path.name} missing): "
                              "it was written with another batching option; resume with that one")
        saved = json.loads((directory / f"batching-rank{rank}.json").read_text())["name"]
        if saved != self.name:
            raise ConfigError(f"{path}: written by batching.name={saved!r}, not {self.name!r}")
        self.load_state_tensors(load_file(str(path)))


REGISTRY: Registry = Registry("batching option")  # name -> class, filled by the modules' `@register`, by name


def register(cls: type[BatchingOption]) -> type[BatchingOption]:
    """Class decorator: adds a batching option to `REGISTRY` under `cls.name`, after checking its declarations."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__qualname__} must declare its own `name` to be registered")
    if not (is_dataclass(cls.config) and issubclass(cls.config, BaseBatchingConfig)):
        raise TypeError(f"{cls.__qualname__}.config must be a dataclass subclassing BaseBatchingConfig")
    if not cls.__doc__:
        raise TypeError(f"{cls.__qualname__} must have a docstring: its line in the batching section's documentation")
    if cls.min_micro_batches < 1:
        raise TypeError(f"{cls.__qualname__}.min_micro_batches must be >= 1")
    return REGISTRY.add(name, cls, cls.__module__)


# -- the pieces of Algorithm 1's step ------------------------------------------------------------------


def propose(parts: StepParts, batch: MicroBatch) -> Subset:
    """Step 1: the strategy's passage subset for the (global) batch, from query vectors without gradient."""
    with torch.no_grad():
        parts.model.eval()
        probe = parts.model.encode_queries(batch.questions).float()
        parts.model.train()
    return parts.strategy.subset(probe, batch.positives)


def my_passages(parts: StepParts, subset: Subset) -> list[dict]:
    """This process's share of the subset's passages (encoded here, gathered with gradient)."""
    return parts.corpus.passages(my_share(subset.rows, parts.accelerator).tolist())


def subset_losses(prepared: torch.nn.Module, parts: StepParts, questions: list[str], passages: list[dict],
                  subset: Subset) -> dict:
    """Steps 2-3 as the prepared module's forward: fresh f(x) and g(y) for y in S (each process encodes 1/N of
    S, gathered with gradient), the strategy's task loss over S and its auxiliary loss."""
    queries, passage_part = prepared.retriever(questions, passages)
    vectors = gather_with_grad(passage_part, len(subset.rows), parts.accelerator)
    scores = retrieval_scores(queries, vectors)
    task_loss, logged = parts.strategy.task_loss(scores, subset)
    aux = parts.strategy.auxiliary_loss(queries.detach(), subset.rows, vectors.detach(), scores.detach())
    return {"loss": task_loss, "aux": aux, "logged": logged, "queries": queries, "vectors": vectors}


def synced_on_last(parts: StepParts, k: int, count: int):
    """Gradients are reduced across processes once per optimizer step: every micro-batch but the last runs its
    forward and backward under DDP's `no_sync` (one process: nothing to skip)."""
    return contextlib.nullcontext() if k == count - 1 else parts.accelerator.no_sync(parts.trainable)


def mean_logged(entries: list[dict[str, float]]) -> dict[str, float]:
    keys = entries[0].keys() if entries else ()
    return {key: sum(e[key] for e in entries) / len(entries) for key in keys}


def rng_devices(device: torch.device) -> list[torch.device]:
    """The devices whose generators `torch.random.fork_rng` must save besides the CPU's: the current CUDA device
    (none on CPU; fork_rng's default would touch every visible GPU)."""
    return [device] if device.type == "cuda" else []


def tower_grad_norms(model: torch.nn.Module) -> dict[str, float]:
    """||grad|| of the query and passage towers and their ratio passage / query: seed 002's diagnosis of
    passage-only banks (the passage tower's gradient dwarfs the query tower's). Empty for shared towers."""
    if model.shared_towers:
        return {}

    def norm(tower: torch.nn.Module) -> float:
        grads = [p.grad.detach().double() for p in tower.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0

    query, passage = norm(model.query_encoder), norm(model.passage_encoder)
    values = {"grad_norm_query": query, "grad_norm_passage": passage}
    if query > 0:
        values["grad_ratio_passage_query"] = passage / query
    return values

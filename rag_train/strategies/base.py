"""The one interface every passage-selection strategy implements, and the pieces they share.

A strategy (a) proposes passages for a batch — per question for Algorithm 2 (`retrieve`), one subset
shared by the whole global batch for Algorithm 1 (`subset`) — and (b) updates its own state after the
optimizer step (`after_step`: refresh, FIFO, ...). It may add trainable modules (the corrector) and an
auxiliary loss over the same subset. Training loops never look at a strategy's name.

A strategy is one module in this package: a `Strategy` subclass decorated with `@register`, declaring its
`name`, its own config dataclass (`config`, a `BaseStrategyConfig` subclass whose fields are the
`strategy.<key>` keys it reads, validated in `__post_init__`), what it needs (`needs_buffer`), what it does
(`retrieves`, `trains_retriever`, a corrector through `modules` / `auxiliary_loss`), which recipes can use it
(`algorithms`) and the values that may not exceed the corpus (`config.corpus_limits`). `rag_train.strategies`
imports every module of the package (`rag_train.plugins.Registry.discover`, the pattern batching options and the GPU
report's stages follow too), so the registry and the config schema follow from these declarations.

Sharding: with N processes each process holds rows [start, end) of the index. Queries are gathered so every
process searches its rows for the whole global batch, and `rag_train.buffer.search` merges the per-process
top-k, so every process sees the same answer as a single process would.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import Callable, ClassVar, ContextManager, Optional

import numpy as np
import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from torch import nn

from rag_train.buffer.distributed import shard_range
from rag_train.buffer.embed import embed_rows
from rag_train.buffer.search import search
from rag_train.buffer.store import Buffer
from rag_train.config import BufferConfig, check_choice, check_positive
from rag_train.data.corpus import Corpus
from rag_train.io import atomic_write_json
from rag_train.losses import truncated_softmax_ce
from rag_train.plugins import Registry


@dataclass
class BaseStrategyConfig:
    """The keys every strategy reads. A strategy's own config subclasses this; all fields are spelled
    `strategy.<field>` in YAML files and `key=value` overrides."""

    name: str = "corrector"  # which strategy: a registered name (rag_train.strategies.REGISTRY)
    top_k: int = 64  # passages retrieved (Alg. 1: shared top-64; Alg. 2: per-question top-32)
    uniform_negatives: int = 64  # Alg. 1 only: uniform targets added to the shared subset

    def __post_init__(self) -> None:
        check_positive("strategy", "top_k", self.top_k)
        check_positive("strategy", "uniform_negatives", self.uniform_negatives, allow_zero=True)

    def corpus_limits(self) -> list[tuple[str, int]]:
        """(key, value) pairs that may not exceed the corpus size, checked before any long work."""
        return [("strategy.top_k", self.top_k)]


@dataclass
class IndexedConfig(BaseStrategyConfig):
    """Keys of strategies that search an index of passage vectors (`IndexedStrategy`)."""

    sampling: str = "topk"  # topk | gumbel (Gumbel-max samples without replacement instead of top-k)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("strategy", "sampling", self.sampling, ("topk", "gumbel"))


REGISTRY: Registry = Registry("strategy")  # name -> class, filled by the modules' `@register`, ordered by name


def register(cls: type["Strategy"]) -> type["Strategy"]:
    """Class decorator: adds a strategy to `REGISTRY` under `cls.name`, after checking its declarations."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__qualname__} must declare its own `name` to be registered")
    if not (is_dataclass(cls.config) and issubclass(cls.config, BaseStrategyConfig)):
        raise TypeError(f"{cls.__qualname__}.config must be a dataclass subclassing BaseStrategyConfig")
    if not cls.algorithms or not set(cls.algorithms) <= {1, 2}:
        raise TypeError(f"{cls.__qualname__}.algorithms must be a non-empty subset of {{1, 2}}")
    return REGISTRY.add(name, cls, cls.__module__)


def _no_gathering(*modules: nn.Module) -> ContextManager:
    return contextlib.nullcontext()


@dataclass
class StrategyContext:
    """What a strategy may use: the (unwrapped) dual encoder to embed passages, the corpus, the stale buffer."""

    accelerator: Accelerator
    model: nn.Module  # rag_train.models.retriever.DualEncoder, unwrapped
    corpus: Corpus
    buffer_cfg: BufferConfig
    buffer_dir: Optional[Path]  # the stale buffer (built before training); None for strategies without one
    temperature: float
    seed: int
    # `with gather(*modules):` the modules hold their full weights on this process (DeepSpeed ZeRO-3: gathered,
    # a collective every process enters; the recipe sets it to `train.trainable.full_weights` once prepared).
    # Wraps everything that runs them outside the training forward, or reads their weights directly.
    gather: Callable[..., ContextManager] = _no_gathering


@dataclass
class Subset:
    """Algorithm 1's shared passage subset for the global batch."""

    rows: torch.Tensor  # [S] global corpus rows, sorted, unique
    positive_index: torch.Tensor  # [B_local] index of each local question's positive in `rows`


def read_rows(buffer: Buffer, rows: torch.Tensor) -> torch.Tensor:
    """buffer[rows] as fp32 for any shape of global row ids (`Buffer.gather`: only those rows are read)."""
    return torch.from_numpy(buffer.gather(rows.reshape(-1).cpu().numpy())).reshape(*rows.shape, buffer.dim)


def gather_queries(queries: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
    return accelerator.gather(queries.detach().contiguous()) if accelerator.num_processes > 1 else queries.detach()


def my_part(global_rows: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
    """The rows of a gathered [B_global, ...] answer that belong to this process's questions."""
    per_rank = global_rows.shape[0] // accelerator.num_processes
    start = accelerator.process_index * per_rank
    return global_rows[start : start + per_rank]


class Strategy:
    """The interface, with default behaviour (no index, no state, no trainable modules). Not a strategy itself:
    a registered subclass declares the class attributes below and overrides `retrieve_global` and, if
    needed, the rest."""

    name: ClassVar[str]  # the value of `strategy.name` that selects it
    config: ClassVar[type[BaseStrategyConfig]] = BaseStrategyConfig  # its own keys: `self.cfg` is one of these
    algorithms: ClassVar[frozenset[int]] = frozenset({1, 2})  # recipes it runs in: Algorithm 1 and / or 2
    needs_buffer: ClassVar[bool] = False  # True: the recipe builds the stale buffer before step 0
    searches: ClassVar[frozenset[str]] = frozenset()  # the `buffer.search` values it supports; none: it has no index
    retrieves: ClassVar[bool] = True  # False: the reader sees no passages (closed book)
    trains_retriever: ClassVar[bool] = True  # False: the retriever is frozen (RLM baseline)

    def __init__(self, cfg: BaseStrategyConfig, ctx: StrategyContext):
        self.cfg = cfg
        self.ctx = ctx
        self.embedded = 0  # passages embedded or re-embedded after the initial buffer build
        self.step = 0
        self.generator = torch.Generator().manual_seed(ctx.seed + 7919)

    def embed(self, rows: np.ndarray) -> torch.Tensor:
        """Current passage-encoder vectors for corpus rows (no gradient). Callers count `embedded`."""
        with self.ctx.gather(self.ctx.model):  # each process embeds its own rows: not in lockstep
            cfg = self.ctx.buffer_cfg
            return embed_rows(self.ctx.model, self.ctx.corpus, rows, cfg.embed_batch_size, self.ctx.accelerator.device,
                              num_workers=cfg.embed_workers, batch_tokens=cfg.embed_batch_tokens)

    def embed_everywhere(self, rows: torch.Tensor) -> torch.Tensor:
        """Current vectors for `rows` on every process: each process embeds its share, all receive all vectors
        (callers count `embedded`)."""
        acc = self.ctx.accelerator
        if acc.num_processes == 1:
            return self.embed(rows.numpy())
        per_rank = -(-len(rows) // acc.num_processes)
        mine = rows[acc.process_index * per_rank : (acc.process_index + 1) * per_rank]
        vectors = self.embed(mine.numpy())
        padded = torch.zeros(per_rank, self.ctx.model.dim, device=acc.device)
        padded[: len(vectors)] = vectors
        return acc.gather(padded)[: len(rows)]

    # -- proposals ---------------------------------------------------------------------------------

    def retrieve(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        """[B_local, k] global corpus rows for each local question (queries detached)."""
        return my_part(self.retrieve_global(queries, k), self.ctx.accelerator)

    def retrieve_global(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        """[B_global, k] rows for every question of the global batch, the same on every process."""
        raise NotImplementedError(f"{type(self).__qualname__} proposes no passages")

    def uniform_rows(self, count: int) -> torch.Tensor:
        """Uniform targets, drawn identically on every process (shared generator state)."""
        return torch.randint(len(self.ctx.corpus), (count,), generator=self.generator)

    def subset(self, queries: torch.Tensor, positive_rows: torch.Tensor) -> Subset:
        """Algorithm 1: union over the global batch of top-k + uniform targets + positives, shared."""
        acc = self.ctx.accelerator
        positives = acc.gather(positive_rows.contiguous()) if acc.num_processes > 1 else positive_rows
        parts = [positives.cpu(), self.uniform_rows(self.cfg.uniform_negatives * len(positives))]
        if self.cfg.top_k > 0:
            parts.append(self.retrieve_global(queries, self.cfg.top_k).reshape(-1).cpu())
        rows = torch.unique(torch.cat(parts))  # sorted: the same order on every process
        positive_index = torch.searchsorted(rows, positive_rows.cpu())
        return Subset(rows=rows, positive_index=positive_index)

    # -- losses ------------------------------------------------------------------------------------

    def task_loss(self, scores: torch.Tensor, subset: Subset) -> tuple[torch.Tensor, dict[str, float]]:
        """Algorithm 1 task loss from fresh inner products [B_local, S] (beta = 1 / temperature applied here)."""
        return truncated_softmax_ce(scores, subset.positive_index.to(scores.device), self.ctx.temperature), {}

    def search_depth(self, k: int) -> int:
        """Algorithm 2: how deep to search for a reader that reads the top k. Rows past k reach only
        `auxiliary_loss` (with fresh vectors, no gradient)."""
        return k

    def auxiliary_loss(
        self, queries: torch.Tensor, rows: torch.Tensor, fresh_vectors: torch.Tensor, fresh_scores: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Extra loss on the same passages (the corrector's). `rows` is [S] (shared subset) or [B, k];
        all inputs are detached, so it can only train the strategy's own modules. None: no extra loss."""
        return None

    def logged_values(self) -> dict[str, float]:
        """Values of the last step the recipe logs, and keeps per logged step in metrics.json (`strategy_log`)."""
        return {}

    @property
    def auxiliary_max_loss(self) -> float:
        """A step whose auxiliary loss is above this skips the update of the `auxiliary` param groups
        (0 = no limit; see train.step.NonFiniteGuard)."""
        return 0.0

    def modules(self) -> dict[str, nn.Module]:
        """The strategy's trainable modules by name (none here). The recipe makes them parts of its one prepared
        module (train.trainable.Trainable), so `auxiliary_loss` must run inside that module's forward."""
        return {}

    def param_groups(self) -> list[dict]:
        """Optimizer param groups of `modules()` (none here). Groups trained only by `auxiliary_loss` carry
        `"auxiliary": True` (see train.step.optimizer_step)."""
        return []

    # -- state ---------------------------------------------------------------------------------------

    def summary(self) -> dict:
        """Strategy-specific values for metrics.json (`strategy_summary`): memory, re-encoding counts, ..."""
        return {}

    def after_step(self, step: int) -> None:
        """Called after each optimizer step with the number of steps done."""
        self.step = step

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint (this process's share); subclasses add their index or cache."""
        return {"generator": self.generator.get_state()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(tensors["generator"])

    def save(self, directory: Path) -> None:
        """Write this process's strategy state into a checkpoint folder (safetensors + json)."""
        rank = self.ctx.accelerator.process_index
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_tensors().items()}
        save_file(tensors, str(directory / f"strategy-rank{rank}.safetensors"))
        atomic_write_json(directory / f"strategy-rank{rank}.json", {"embedded": self.embedded, "step": self.step})

    def load(self, directory: Path) -> None:
        rank = self.ctx.accelerator.process_index
        meta = json.loads((directory / f"strategy-rank{rank}.json").read_text())
        self.embedded, self.step = int(meta["embedded"]), int(meta["step"])
        self.load_state_tensors(load_file(str(directory / f"strategy-rank{rank}.safetensors")))


class IndexedStrategy(Strategy):
    """A strategy that searches an index of passage vectors, sharded over processes.

    This process holds `self.vectors`, the index entries [row_offset, row_offset + len) of the whole
    index. `self.index_rows` maps index positions to corpus rows (None: the index is the whole corpus).
    Subclasses decide what fills them and when.
    """

    config = IndexedConfig
    searches = frozenset({"full"})
    corrector: Optional[nn.Module] = None
    faiss_index = None  # candidate index over `vectors` (buffer.search=rerank only)

    def __init__(self, cfg: IndexedConfig, ctx: StrategyContext):
        super().__init__(cfg, ctx)
        self.vectors: torch.Tensor | np.ndarray = torch.zeros(0)
        self.index_rows: Optional[torch.Tensor] = None
        self.row_offset = 0

    @property
    def search_mode(self) -> str:
        """`rag_train.buffer.search.search`'s mode for `buffer.search` (through the corrector when there is one)."""
        if self.ctx.buffer_cfg.search == "rerank":
            return "corrector_rerank"  # re-scores with <q, b> when there is no corrector
        return "exact" if self.corrector is None else "corrector_full"

    def local_range(self, total: int) -> tuple[int, int]:
        return shard_range(total, self.ctx.accelerator.process_index, self.ctx.accelerator.num_processes)

    def retrieve_global(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        device = self.vectors.device if isinstance(self.vectors, torch.Tensor) else torch.device("cpu")
        all_queries = gather_queries(queries, self.ctx.accelerator).float().to(device)
        weights = self.ctx.gather(self.corrector) if self.corrector is not None else contextlib.nullcontext()
        with torch.no_grad(), weights:  # the search reads the corrector's weights directly
            result = search(
                all_queries,
                self.vectors,
                k,
                corrector=self.corrector,
                mode=self.search_mode,
                chunk_rows=self.ctx.buffer_cfg.chunk_rows,
                sampling=self.cfg.sampling,
                temperature=self.ctx.temperature,
                generator=self.generator,
                row_offset=self.row_offset,
                faiss_index=self.faiss_index,
                candidates=self.ctx.buffer_cfg.rerank_candidates,
                fused=self.ctx.buffer_cfg.fused_search,
            )
        rows = result.rows.cpu()
        if self.index_rows is not None:  # positions in a sampled index -> corpus rows
            rows = self.index_rows[rows]
        return rows

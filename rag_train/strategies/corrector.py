"""Corrector networks (seed 000): search <f(x), h(B[y])> over the never-refreshed stale buffer, and train h
on the same passages so that the corrected scores match the fresh ones.

Beyond the paper, three optional keys (all off by default: a run without them is the paper's, bit for bit): more
updates of h per step, a replay of the last steps' (rows, fresh g(y)) pairs, and a drift-aware refresh that
re-embeds the buffer only when h stops tracking g (`CorrectorConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from rag_train.buffer.distributed import shard_range
from rag_train.config import ConfigError, check_choice, check_positive
from rag_train.losses import corrector_ce, corrector_mse, retrieval_scores
from rag_train.models.corrector import Corrector
from rag_train.strategies.base import IndexedConfig, StrategyContext, register
from rag_train.strategies.stale import Stale, search_device

WATCHABLE = ("subset_overlap@4", "cos_stale", "cos_corrected")  # `tracking_values`' entries, without "corrector/"

@dataclass
class CorrectorConfig:
    """h(b) = b + W2 relu(W1 b + c1) + c2, W2 = 0 at init (seed 000). Keys `strategy.corrector.<key>`."""

    hidden: int = 8192
    # the width as a multiple of the buffer's dimension D: > 0 sets hidden = round(hidden_multiple * D) (the paper's
    # 8192 for D = 768 is 10.67); 0 = `hidden` as written
    hidden_multiple: float = 0.0
    loss: str = "ce"  # ce (Eq. 6, preferred) | mse (Eq. 5)
    weight: float = 10.0
    lr: float = 1e-4
    # Algorithm 2: h trains on the top-`candidates` of its own ranking (fresh g(y) for them, no gradient); the
    # reader and perplexity distillation still read the top strategy.top_k. 0 = top_k (the paper, k = 32). A
    # small k shows h too little of the ranking to learn which passages the moving retriever now ranks high.
    candidates: int = 0
    # divergence guard: a step whose (weighted) corrector loss is above this skips the corrector's update and
    # keeps the encoder's (0 = off; a non-finite corrector loss or gradient always skips it). See
    # train.step.optimizer_step; train.max_bad_steps such steps in a row stop the run.
    max_loss: float = 0.0
    # the first layer reads the stale vectors standardized by the buffer's own per-dimension mean and sd (computed
    # once at start: the buffer never changes); the same function class, but hidden units that respond to how
    # passages differ, not to the direction an anisotropic language-model buffer shares (docs/described_table1_log.md)
    standardize: bool = False
    # optimizer updates of h per training step on the step's (rows, fresh g(y)) pairs (and the replay): the first
    # is the recipe's optimizer step, the other updates - 1 run right after it with h's own AdamW (lr above), from
    # detached vectors, so they move h alone and the towers' gradients stay as they are. Not under DeepSpeed. What
    # these keys cost per step: docs/retriever_strategies.md, "The corrector beyond the paper".
    updates: int = 1
    # keep the last N steps' (rows, fresh g(y), query vectors), all detached, and add them to every update of h: the
    # loss is the mean over this step's pairs and theirs. No extra embedding: B[rows] is read again, g(y) reused.
    replay_steps: int = 0
    # drift-aware refresh (no paper): when the watched tracking value on the step's subset, averaged over the last
    # refresh_window steps, falls below refresh_below, the buffer is re-embedded with the current passage encoder (as
    # exhaustive does) and h is reset to the identity, exact right after a re-embed (B = g). 0 = never.
    refresh_below: float = 0.0
    refresh_window: int = 10
    # which `tracking_values` entry it watches: subset_overlap@4 (h's top-4 against the fresh top-4), cos_stale
    # (cos(B[y], g(y)): how far the buffer itself has drifted) or cos_corrected (cos(h(B[y]), g(y)))
    refresh_watch: str = "subset_overlap@4"

    def __post_init__(self) -> None:
        check_positive("strategy.corrector", "hidden", self.hidden)
        check_positive("strategy.corrector", "hidden_multiple", self.hidden_multiple, allow_zero=True)
        check_choice("strategy.corrector", "loss", self.loss, ("ce", "mse"))
        check_positive("strategy.corrector", "weight", self.weight, allow_zero=True)
        check_positive("strategy.corrector", "lr", self.lr)
        check_positive("strategy.corrector", "max_loss", self.max_loss, allow_zero=True)
        check_positive("strategy.corrector", "candidates", self.candidates, allow_zero=True)
        check_positive("strategy.corrector", "updates", self.updates)
        check_positive("strategy.corrector", "replay_steps", self.replay_steps, allow_zero=True)
        check_positive("strategy.corrector", "refresh_below", self.refresh_below, allow_zero=True)
        if self.refresh_below > 1:
            raise ConfigError(f"strategy.corrector.refresh_below={self.refresh_below!r} is an overlap or a cosine: "
                              "at most 1")
        check_positive("strategy.corrector", "refresh_window", self.refresh_window)
        check_choice("strategy.corrector", "refresh_watch", self.refresh_watch, WATCHABLE)

    def width(self, dim: int) -> int:
        """Hidden units for a buffer of dimension `dim`."""
        if self.hidden_multiple <= 0:
            return self.hidden
        hidden = round(self.hidden_multiple * dim)
        if hidden < 1:
            raise ConfigError(f"strategy.corrector.hidden_multiple={self.hidden_multiple} x D={dim} rounds to "
                              f"{hidden} hidden units; it needs at least 1")
        return hidden


@dataclass
class CorrectorStrategyConfig(IndexedConfig):
    corrector: CorrectorConfig = field(default_factory=CorrectorConfig)


class Pair(NamedTuple):
    """One call's corrector training data, detached: query vectors, the buffer rows, their fresh g(y)."""

    queries: torch.Tensor  # [B, D]
    rows: torch.Tensor  # [S] (Algorithm 1's shared subset) or [B, k]
    fresh: torch.Tensor  # [S, D] or [B, k, D]




@register
class CorrectorStrategy(Stale):
    """Stale buffer + corrector h. Search uses h (no gradient); the corrector loss — CE(P~ || P~_h) or MSE —
    sees only detached encoder outputs, so it updates h alone, and the task loss never reaches h."""

    name = "corrector"
    config = CorrectorStrategyConfig

    def __init__(self, cfg: CorrectorStrategyConfig, ctx: StrategyContext):
        super().__init__(cfg, ctx)
        own = cfg.corrector
        if ctx.accelerator.state.deepspeed_plugin is not None and (own.updates > 1 or own.refresh_below > 0):
            raise ConfigError("strategy.corrector.updates > 1 and strategy.corrector.refresh_below change h outside "
                              "the recipe's optimizer step, which DeepSpeed's engine (it holds h's master weights) "
                              "cannot take; leave them at 1 and 0 under DeepSpeed")
        if own.refresh_below > 0 and ctx.buffer_cfg.search == "rerank":
            raise ConfigError("strategy.corrector.refresh_below re-embeds the buffer, which a FAISS index over the "
                              "stale buffer (buffer.search=rerank) would not follow; use buffer.search=full")
        self.corrector = Corrector(self.buffer.dim, own.width(self.buffer.dim), own.standardize).to(search_device(ctx))
        if own.standardize:
            self.corrector.set_input_statistics(*self.buffer.moments())
        # times each corpus row was in the corrector's training subset, saturating at 255 (one byte a row): which
        # rows h has seen, for scripts/diagnose_retriever.py (checkpointed with the strategy's state)
        self.seen = torch.zeros(len(ctx.corpus), dtype=torch.uint8)
        self.tracked: dict[str, torch.Tensor] = {}  # the last step's `tracking_values`
        self.pending: list[Pair] = []  # this step's pairs (one per `auxiliary_loss` call), kept for updates / replay
        self.keeps_pairs = own.updates > 1 or own.replay_steps > 0
        self.trained = False  # a corrector loss ran since the last `after_step`
        self.replay: list[tuple[int, Pair]] = []  # (step, pair) of the last `replay_steps` steps
        # h's own optimizer for the updates after the first (its moments are checkpointed with the strategy)
        self.optimizer = (torch.optim.AdamW(self.corrector.parameters(), lr=own.lr, weight_decay=0.0)
                          if own.updates > 1 else None)
        self.drift_key = f"corrector/{own.refresh_watch}"  # the `tracking_values` entry the refresh policy watches
        self.window: list[float] = []  # the last `refresh_window` steps' watched values (mean over processes)
        self.refresh_steps: list[int] = []  # steps after which the buffer was re-embedded
        self.refreshed: Optional[torch.Tensor] = None  # the re-embedded buffer, every row (after a refresh)

    @property
    def auxiliary_max_loss(self) -> float:
        return self.cfg.corrector.max_loss

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"corrector": self.corrector}

    def param_groups(self) -> list[dict]:
        # "auxiliary": optimizer_step leaves it out of the clipping norm and drops its update when the corrector
        # diverges
        return [{"params": list(self.corrector.parameters()), "lr": self.cfg.corrector.lr, "weight_decay": 0.0,
                 "auxiliary": True}]

    def stale_vectors(self, rows: torch.Tensor) -> torch.Tensor:
        """B[rows]: the buffer on disk, or the re-embedded one after a refresh."""
        if self.refreshed is None:
            return super().stale_vectors(rows)
        return self.refreshed[rows.reshape(-1).cpu()].reshape(*rows.shape, self.buffer.dim)

    def count_seen(self, rows: torch.Tensor) -> None:
        unique = rows.reshape(-1).unique().cpu()
        self.seen[unique] = (self.seen[unique].int() + 1).clamp_(max=255).to(torch.uint8)

    def search_depth(self, k: int) -> int:
        return max(k, self.cfg.corrector.candidates)

    def pair_loss(self, pair: Pair, fresh_scores: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """The unweighted corrector loss on one pair, with B[rows], h(B[rows]) and the corrected scores."""
        if fresh_scores is None:
            fresh_scores = retrieval_scores(pair.queries, pair.fresh)
        dtype = next(self.corrector.parameters()).dtype  # the engine's (bf16 under DeepSpeed bf16), else fp32
        stale = self.stale_vectors(pair.rows).to(fresh_scores.device, dtype)
        corrected = self.corrector(stale)
        corrected_scores = retrieval_scores(pair.queries, corrected)  # [B, S] shared subset or [B, k] per question
        if self.cfg.corrector.loss == "mse":
            return corrector_mse(pair.fresh, corrected), stale, corrected, corrected_scores
        return corrector_ce(fresh_scores, corrected_scores, self.ctx.temperature), stale, corrected, corrected_scores

    def auxiliary_loss(
        self, queries: torch.Tensor, rows: torch.Tensor, fresh_vectors: torch.Tensor, fresh_scores: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Runs inside the recipe's training forward (the corrector is a part of its prepared module)."""
        self.count_seen(rows)
        pair = Pair(queries.detach(), rows, fresh_vectors.detach())
        loss, stale, corrected, corrected_scores = self.pair_loss(pair, fresh_scores)
        self.tracked = tracking_values(stale, corrected.detach(), fresh_vectors, corrected_scores.detach(),
                                       fresh_scores)
        self.trained = True
        if self.keeps_pairs:
            self.pending.append(pair)
        if self.replay:
            loss = torch.stack([loss] + [self.pair_loss(old)[0] for _, old in self.replay]).mean()
        return self.cfg.corrector.weight * loss

    def logged_values(self) -> dict[str, float]:
        return {key: value.item() for key, value in self.tracked.items()}

    def summary(self) -> dict:
        return {"refresh_steps": list(self.refresh_steps)} if self.cfg.corrector.refresh_below > 0 else {}

    # -- after the optimizer step: more updates of h, the replay, the drift-aware refresh -----------------------

    def after_step(self, step: int) -> None:
        super().after_step(step)
        pairs, self.pending, trained, self.trained = self.pending, [], self.trained, False
        if not trained:  # no corrector loss this step (Algorithm 2 before its gate opens)
            return
        if self.optimizer is not None:
            self.extra_updates(pairs + [old for _, old in self.replay])
        if self.cfg.corrector.replay_steps:
            oldest = step - self.cfg.corrector.replay_steps
            self.replay = [(s, old) for s, old in self.replay if s > oldest] + [(step, p) for p in pairs]
        if self.cfg.corrector.refresh_below > 0:
            self.watch_drift(step)

    def extra_updates(self, pairs: list[Pair]) -> None:
        """`updates - 1` AdamW steps of h alone on `pairs` (the gradient averaged over processes, as DDP's is). A
        non-finite loss or gradient, or a loss above `max_loss`, stops them (decided alike on every process)."""
        acc, own = self.ctx.accelerator, self.cfg.corrector
        params = list(self.corrector.parameters())
        for _ in range(own.updates - 1):
            loss = own.weight * torch.stack([self.pair_loss(pair)[0] for pair in pairs]).mean()
            loss.backward()
            grads = [p.grad for p in params]
            check = torch.stack([loss.detach().float()] + [torch.linalg.vector_norm(g.float()) for g in grads])
            if acc.num_processes > 1:
                for grad in grads:
                    grad.copy_(acc.reduce(grad, "mean"))
                check = acc.reduce(check, "mean")
            good = bool(torch.isfinite(check).all()) and not (own.max_loss > 0 and check[0].item() > own.max_loss)
            if good:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if not good:
                return

    def watch_drift(self, step: int) -> None:
        """The refresh policy: re-embed when the windowed mean of the watched value (over processes) is below the
        threshold."""
        acc, own = self.ctx.accelerator, self.cfg.corrector
        value = self.tracked[self.drift_key].detach().float().reshape(1).to(acc.device)
        if acc.num_processes > 1:
            value = acc.reduce(value, "mean")
        self.window = (self.window + [value.item()])[-own.refresh_window:]
        if len(self.window) == own.refresh_window and sum(self.window) / len(self.window) < own.refresh_below:
            self.refresh(step)

    def refresh(self, step: int) -> None:
        """Re-embed the whole buffer (Stale.reembed, counted in `embedded`) and reset h to the identity: W2 and c2
        back to 0, W1 and c1 kept (any W1 gives the identity then, and its features of the passages stay a basis).
        The replay's pairs, fitted to the old buffer, are dropped."""
        self.reembed()
        self.refreshed = self.all_rows()
        with self.ctx.gather(self.corrector), torch.no_grad():
            self.corrector.second.weight.zero_()
            self.corrector.second.bias.zero_()
            if self.cfg.corrector.standardize:
                wide = self.refreshed.double()
                self.corrector.set_input_statistics(wide.mean(0), wide.std(0, unbiased=False))
        self.window, self.replay = [], []
        self.refresh_steps.append(step)

    def all_rows(self) -> torch.Tensor:
        """The re-embedded buffer, every row, fp32 on the CPU of every process (each holds its own rows)."""
        acc = self.ctx.accelerator
        if acc.num_processes == 1:
            return self.vectors.float().cpu()
        width = -(-self.buffer.rows // acc.num_processes)
        padded = torch.zeros(width, self.buffer.dim, device=acc.device)
        padded[: len(self.vectors)] = self.vectors.float()
        parts = acc.gather(padded).cpu().view(acc.num_processes, width, -1)
        ranges = [shard_range(self.buffer.rows, rank, acc.num_processes) for rank in range(acc.num_processes)]
        return torch.cat([parts[rank, : end - start] for rank, (start, end) in enumerate(ranges)])

    # -- state ---------------------------------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = dict(super().state_tensors(), seen=self.seen)
        if self.cfg.corrector.refresh_below > 0:
            tensors.update(refresh_steps=torch.tensor(self.refresh_steps, dtype=torch.int64),
                           drift_window=torch.tensor(self.window, dtype=torch.float64))
            if self.refreshed is not None:
                tensors["vectors"] = self.vectors
        for i, (step, pair) in enumerate(self.replay):
            tensors.update({f"replay/{i}/step": torch.tensor(step), f"replay/{i}/queries": pair.queries,
                            f"replay/{i}/rows": pair.rows, f"replay/{i}/fresh": pair.fresh})
        if self.optimizer is not None:
            for index, state in self.optimizer.state_dict()["state"].items():
                tensors.update({f"updates_optimizer/{index}/{name}": value for name, value in state.items()})
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.seen = tensors["seen"]
        if self.cfg.corrector.refresh_below > 0:
            self.refresh_steps = tensors["refresh_steps"].tolist()
            self.window = tensors["drift_window"].tolist()
            if "vectors" in tensors:
                self.vectors = tensors["vectors"].to(self.vectors.device, self.vectors.dtype)
                self.refreshed = self.all_rows()
        device = self.ctx.accelerator.device
        self.replay = [(int(tensors[f"replay/{i}/step"]),
                        Pair(tensors[f"replay/{i}/queries"].to(device), tensors[f"replay/{i}/rows"],
                             tensors[f"replay/{i}/fresh"].to(device)))
                       for i in range(sum(key.endswith("/step") and key.startswith("replay/") for key in tensors))]
        if self.optimizer is not None:
            state: dict[int, dict] = {}
            for key, value in tensors.items():
                if key.startswith("updates_optimizer/"):
                    _, index, name = key.split("/")
                    state.setdefault(int(index), {})[name] = value
            groups = self.optimizer.state_dict()["param_groups"]
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})


TRACKED_TOP = 4  # the subset ranking's head compared by `tracking_values`


@torch.no_grad()
def tracking_values(stale: torch.Tensor, corrected: torch.Tensor, fresh: torch.Tensor, corrected_scores: torch.Tensor,
                    fresh_scores: torch.Tensor) -> dict[str, torch.Tensor]:
    """How closely h follows g on the subset it trains on this step (tensors: no device sync until logged):
    mean cosine of B[y] and of h(B[y]) with the fresh g(y), and the overlap of each question's top-4 of the subset
    under <f(x), h(B[y])> with its top-4 under <f(x), g(y)> (scripts/diagnose_retriever.py measures the whole
    corpus after training)."""
    def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean()

    k = min(TRACKED_TOP, fresh_scores.shape[-1])
    top_fresh = fresh_scores.topk(k, dim=-1).indices
    top_corrected = corrected_scores.topk(k, dim=-1).indices
    overlap = (top_fresh.unsqueeze(-1) == top_corrected.unsqueeze(-2)).any(dim=-1).float().mean()
    return {"corrector/cos_stale": cosine(stale, fresh), "corrector/cos_corrected": cosine(corrected, fresh),
            "corrector/subset_overlap@4": overlap}

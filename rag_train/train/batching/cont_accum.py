"""`batching.name=cont_accum`: ContAccum (seed 002, Kim et al. 2024): K micro-batches whose softmax also spans
dual FIFO memory banks of past query, positive (and hard-negative) vectors.

Per micro-batch k (of N_local questions per process; the bank is the same on every process):
  1. the strategy's subset S_k for the micro-batch (its positives and the strategy's negatives);
  2. fresh f(x) and g(y), y in S_k, with gradient;
  3. rows [f(x); M_q], columns [g(S_k); M_p; M_h]; a fresh row's label is its positive in S_k, a banked query's
     its banked positive (banked queries are loss rows: they train the passage tower). Cross-entropy over all
     rows, back-propagated with weight 1/K;
  4. AFTER the logits, the micro-batch's query, positive and hard-negative vectors (detached) are enqueued, the
     oldest dropped beyond `bank_size`. The banks are not emptied at optimizer steps: they hold vectors of past
     encoders, as the paper's do (`bank_past_encoders=false` empties them, the paper's "w/o Past Enc." ablation).
The hard negative of a question is the highest-scoring passage of its subset that is no positive of the
micro-batch (a strategy that adds negatives; otherwise the slot is empty and masked). Under DDP the banks hold
the global micro-batches, and each process takes 1/N of the banked rows, so the loss is the one process's.

Takes strategies that keep the base task loss (the truncated softmax): ContAccum replaces it by its banked
softmax, so a strategy with a loss of its own (the negative cache's surrogate) is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rag_train.config import ConfigError, check_positive
from rag_train.losses import retrieval_scores, truncated_softmax_ce
from rag_train.strategies.base import Strategy, Subset, gather_queries
from rag_train.train.batching.base import (
    BatchingOption,
    MicroBatch,
    MicroBatchesConfig,
    StepParts,
    StepResult,
    my_passages,
    propose,
    register,
    rng_devices,
    synced_on_last,
    tower_grad_norms,
)
from rag_train.train.passages import gather_with_grad


class Banks:
    """FIFO banks M_q, M_p, M_h of `capacity` slots, slot j of each one training triple (query, its positive, its
    hard negative) with the positive's and hard negative's corpus rows (-1: empty hard-negative slot).
    Preallocated (memory flat whatever the step), never part of a graph. Slots fill 0, 1, ...; once full the
    oldest slot is overwritten, so the occupied slots are always the first `size`."""

    def __init__(self, capacity: int, dim: int, device: torch.device, hard_negatives: bool,
                 dtype: torch.dtype = torch.float32):
        self.capacity = capacity
        self.q = torch.zeros(capacity, dim, device=device, dtype=dtype)
        self.p = torch.zeros(capacity, dim, device=device, dtype=dtype)
        self.p_rows = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.h = torch.zeros(capacity, dim, device=device, dtype=dtype) if hard_negatives else None
        self.h_rows = torch.full((capacity,), -1, dtype=torch.long, device=device) if hard_negatives else None
        self.size = 0
        self.next = 0  # the slot written next: the oldest once full

    def empty(self) -> None:
        """No occupied slot (the storage stays: only the first `size` slots are ever read)."""
        self.size = self.next = 0

    def enqueue(self, q: torch.Tensor, p: torch.Tensor, p_rows: torch.Tensor, h=None, h_rows=None) -> None:
        if self.capacity == 0:
            return
        keep = slice(max(0, len(q) - self.capacity), len(q))  # more than the bank holds: the newest
        q, p, p_rows = q[keep], p[keep], p_rows[keep]
        slots = (self.next + torch.arange(len(q), device=self.q.device)) % self.capacity
        with torch.no_grad():
            self.q[slots] = q.detach().to(self.q.dtype)
            self.p[slots] = p.detach().to(self.p.dtype)
            self.p_rows[slots] = p_rows.to(self.p_rows.device)
            if self.h is not None:
                self.h[slots] = h[keep].detach().to(self.h.dtype)
                self.h_rows[slots] = h_rows[keep].to(self.h_rows.device)
        self.next = int((self.next + len(q)) % self.capacity)
        self.size = min(self.size + len(q), self.capacity)

    def ordered(self) -> dict[str, torch.Tensor]:
        """The occupied slots oldest first."""
        order = (self.next - self.size + torch.arange(self.size, device=self.q.device)) % max(self.capacity, 1)
        named = {"q": self.q, "p": self.p, "p_rows": self.p_rows, "h": self.h, "h_rows": self.h_rows}
        return {name: bank[order] for name, bank in named.items() if bank is not None}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        named = {"q": self.q, "p": self.p, "p_rows": self.p_rows, "h": self.h, "h_rows": self.h_rows}
        return {**{f"bank_{k}": v for k, v in named.items() if v is not None},
                "bank_pointer": torch.tensor([self.size, self.next])}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in ("q", "p", "p_rows", "h", "h_rows"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(tensors[f"bank_{name}"])
        self.size, self.next = (int(v) for v in tensors["bank_pointer"])


def hardest_negatives(queries: torch.Tensor, vectors: torch.Tensor, rows: torch.Tensor, positives: torch.Tensor):
    """Per query, the highest-scoring subset passage that is no positive of the micro-batch: (vectors, rows), the
    row -1 where the subset has none."""
    scores = queries.float() @ vectors.float().T
    is_positive = torch.isin(rows.to(scores.device), positives.to(scores.device))
    scores = scores.masked_fill(is_positive.unsqueeze(0), float("-inf"))
    best = scores.argmax(dim=1)
    found = torch.isfinite(scores.max(dim=1).values)
    h_rows = torch.where(found, rows.to(best.device)[best], torch.full_like(best, -1))
    return vectors[best] * found.unsqueeze(1).to(vectors.dtype), h_rows


def fresh_minus_banked_score(out: dict, banked: torch.Tensor) -> float:
    """A fresh query's mean score with the micro-batch's fresh passages that are not its positive, minus its mean
    score with the banked positives M_p, averaged over the fresh queries: above 0 and growing, the loss is being
    lowered by telling the current encoder's passages from the banked ones rather than by relevance (nan without
    a fresh negative)."""
    queries, vectors = out["queries"].to(banked.dtype), out["vectors"].to(banked.dtype)  # the weights' dtype
    fresh = queries @ vectors.T
    negative = torch.ones_like(fresh, dtype=torch.bool)
    negative[torch.arange(len(queries)), out["subset"].positive_index.to(fresh.device)] = False
    return float(fresh[negative].mean() - (queries @ banked.T).mean())


@dataclass
class ContAccumConfig(MicroBatchesConfig):
    """ContAccum's keys: the banks' capacity and what they hold."""

    bank_size: int = 0  # M: the bank capacity, in training triples (0 = no bank: grad_accum's loss)
    # banked queries are loss rows with their banked positives (the paper); false = a passage-only bank
    # (pre-batch negatives, the paper's ablation without M_q: the passage tower's gradient then dwarfs the query's)
    bank_queries: bool = True
    # bank, per banked query, its hardest non-positive passage of the subset (M_h: in seed 002's official code,
    # not in the paper's text, which names M_q and M_p only); a query whose subset has none (in_batch without
    # extra negatives) leaves its slot empty (masked)
    bank_hard_negatives: bool = True
    # a column holding the row's own positive passage (same corpus row) that is not its label column is left out
    # of that row's softmax (the paper does not mask; duplicates then count as negatives)
    mask_false_negatives: bool = False
    # false: the banks are emptied at each optimizer step, so micro-batch k sees only this step's micro-batches
    # 0..k-1, encoded by the current weights (seed 002's "w/o Past Enc." ablation, Table 2: -2.3 Top@20)
    bank_past_encoders: bool = True
    # diagnosis of seed 002's Figure 5: before each step, at the step's weights, each tower's gradient
    # norm and each loss's gradient with respect to the fresh query and passage vectors, with the banks as the step
    # finds them, without the banked query rows, and with the banks hidden (GradAccum's loss), logged as
    # `probe/<banks|no_bank_rows|no_banks>/*` per step; quadruples the step's work and leaves the run's
    # gradients, banks and random state as they are without it
    probe_gradients: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("batching", "bank_size", self.bank_size, allow_zero=True)


@register
class ContAccum(BatchingOption):
    """K micro-batches plus FIFO banks of past query / positive / hard-negative vectors that join each
    micro-batch's softmax as rows and columns (banked queries are loss rows)."""

    name = "cont_accum"
    config = ContAccumConfig

    def __init__(self, cfg: ContAccumConfig, parts: StepParts):
        super().__init__(cfg, parts)
        dtype = next(parts.model.parameters()).dtype  # fp32 under mixed precision (the weights' dtype)
        self.banks = Banks(cfg.bank_size, parts.model.dim, parts.accelerator.device, cfg.bank_hard_negatives, dtype)

    @classmethod
    def check(cls, cfg: ContAccumConfig, strategy: type[Strategy], world: int) -> None:
        if strategy.task_loss is not Strategy.task_loss:
            raise ConfigError(f"batching.name=cont_accum replaces the task loss by its banked softmax, and strategy "
                              f"{strategy.__name__} has a loss of its own; take grad_cache or grad_accum with it")
        if cfg.bank_size % world:
            raise ConfigError(f"batching.bank_size={cfg.bank_size} must be divisible by the {world} processes "
                              "(each one takes the same share of the banked rows)")

    def step(self, micro_batches: list[MicroBatch]) -> StepResult:
        count = len(micro_batches)
        if not self.cfg.bank_past_encoders:
            self.banks.empty()
        probed = {}
        if self.cfg.probe_gradients:
            variants = ("banks", "no_bank_rows", "no_banks") if self.cfg.bank_queries else ("banks", "no_banks")
            for variant in variants:  # (a passage-only bank has no banked query rows to drop)
                probed.update({f"probe/{variant}/{key}": value
                               for key, value in self.probe(micro_batches, variant).items()})
        losses, auxes, columns = [], [], 0
        for k, batch in enumerate(micro_batches):
            with synced_on_last(self.parts, k, count):
                out = self.micro_step(batch, 1.0 / count)
            self.enqueue(out)  # 4. after the logits
            losses.append(out["loss"].detach())
            if out["aux"] is not None:
                auxes.append(out["aux"].detach())
            columns += out["columns"]
        return StepResult(sum(losses) / count, sum(auxes) / count if auxes else None, backward_done=True,
                          columns=columns / count, logged={"bank": float(self.banks.size), **probed})

    def probe(self, micro_batches: list[MicroBatch], variant: str) -> dict[str, float]:
        """`probe_gradients`: this step's micro-batches run at the current weights as `step` runs them (`banks`:
        each micro-batch against the banks, enqueued after its logits), without the banked query rows (M_p and
        M_h columns only: `no_bank_rows`) or with the banks hidden (`no_banks`): each tower's gradient norm
        (`tower_grad_norms`), the mean over micro-batches of ||dL/dQ|| and ||dL/dV|| (the loss's gradient with
        respect to the fresh query vectors and the subset's passage vectors, before the towers' Jacobians) and the
        fresh vectors' mean norms; with banks, `fresh_minus_banked_score` over the micro-batches that found M_p
        occupied. Gradients, banks, the strategy's state (its generator draws the uniform
        negatives) and the global random state are restored afterwards."""
        params, strategy = list(self.parts.model.parameters()), self.parts.strategy
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        state = {name: tensor.clone() for name, tensor in self.banks.state_tensors().items()}
        strategy_state = {name: tensor.clone() for name, tensor in strategy.state_tensors().items()}
        cfg = self.cfg
        if variant == "no_bank_rows":
            self.cfg = dataclasses.replace(cfg, bank_queries=False)
        elif variant == "no_banks":
            self.banks.empty()
        sums, margins = dict.fromkeys(("dloss_dquery", "dloss_dpassage", "query_norm", "passage_norm"), 0.0), []
        with torch.random.fork_rng(devices=rng_devices(self.parts.accelerator.device)):
            for k, batch in enumerate(micro_batches):
                with synced_on_last(self.parts, k, len(micro_batches)):
                    out = self.micro_step(batch, 1.0 / len(micro_batches), vector_grads=True)
                if variant != "no_banks":
                    if self.banks.size:
                        margins.append(fresh_minus_banked_score(out, self.banks.p[: self.banks.size]))
                    self.enqueue(out)
                sums["dloss_dquery"] += float(out["query_grad"].norm())
                sums["dloss_dpassage"] += float(out["vector_grad"].norm())
                sums["query_norm"] += float(out["queries"].norm(dim=1).mean())
                sums["passage_norm"] += float(out["vectors"].norm(dim=1).mean())
        values = {**tower_grad_norms(self.parts.model), **{k: v / len(micro_batches) for k, v in sums.items()}}
        if margins:
            values["fresh_minus_banked_score"] = sum(margins) / len(margins)
        for p, grad in zip(params, grads):
            p.grad = grad
        self.cfg = cfg
        self.banks.load_state_tensors(state)
        strategy.load_state_tensors(strategy_state)
        return values

    def micro_step(self, batch: MicroBatch, weight: float, vector_grads: bool = False) -> dict:
        """Steps 1-3 for one micro-batch against the banks as they are: forward and backward (loss x weight).
        `vector_grads`: also the task loss's gradient with respect to the fresh query and passage vectors."""
        subset = propose(self.parts, batch)
        out = self.parts.trainable(self.losses, batch, my_passages(self.parts, subset), subset)
        if vector_grads:
            out["query_grad"], out["vector_grad"] = torch.autograd.grad(
                out["loss"], [out.pop("query_graph"), out.pop("vector_graph")], retain_graph=True)
        total = out["loss"] if out["aux"] is None else out["loss"] + out["aux"]
        self.parts.accelerator.backward(total * weight)
        return out

    def losses(self, prepared: torch.nn.Module, batch: MicroBatch, passages: list[dict], subset: Subset) -> dict:
        acc, banks = self.parts.accelerator, self.banks
        queries, part = prepared.retriever(batch.questions, passages)
        vectors = gather_with_grad(part, len(subset.rows), acc)
        size, fresh = banks.size, len(subset.rows)
        share = size // acc.num_processes
        mine = slice(acc.process_index * share, (acc.process_index + 1) * share)
        labels = subset.positive_index.to(queries.device)
        row_positive, columns, column_rows = batch.positives.to(queries.device), [vectors], [subset.rows]
        rows = queries
        if size:
            columns.append(banks.p[:size].to(vectors.dtype))
            column_rows.append(banks.p_rows[:size])
            if banks.h is not None:
                columns.append(banks.h[:size].to(vectors.dtype))
                column_rows.append(banks.h_rows[:size])
            if self.cfg.bank_queries:
                rows = torch.cat([queries, banks.q[mine].to(queries.dtype)])
                labels = torch.cat([labels, fresh + torch.arange(size, device=labels.device)[mine]])
                row_positive = torch.cat([row_positive, banks.p_rows[mine].to(row_positive.device)])
            columns = [torch.cat(columns)]
        scores = retrieval_scores(rows, columns[0])
        if size:
            column_rows = torch.cat([r.to(scores.device) for r in column_rows])
            masked = (column_rows == -1).unsqueeze(0).expand_as(scores)  # empty hard-negative slots
            if self.cfg.mask_false_negatives:
                same = column_rows.unsqueeze(0) == row_positive.unsqueeze(1)
                not_label = torch.arange(scores.shape[1], device=scores.device).unsqueeze(0) != labels.unsqueeze(1)
                masked = masked | (same & not_label)
            if bool(masked.any()):
                scores = scores.masked_fill(masked, float("-inf"))
        loss = truncated_softmax_ce(scores, labels, self.parts.temperature)
        fresh_scores = scores[: len(queries), :fresh].detach()
        aux = self.parts.strategy.auxiliary_loss(queries.detach(), subset.rows, vectors.detach(), fresh_scores)
        return {"loss": loss, "aux": aux, "queries": queries.detach(), "vectors": vectors.detach(), "subset": subset,
                "positives": batch.positives, "columns": scores.shape[1], "query_graph": queries,
                "vector_graph": vectors}

    def enqueue(self, out: dict) -> None:
        """The global micro-batch's (query, positive, hard negative) triples, in process order."""
        if self.banks.capacity == 0:
            return
        acc = self.parts.accelerator
        queries = gather_queries(out["queries"], acc)
        local = out["positives"].to(acc.device)
        positives = (acc.gather(local.contiguous()) if acc.num_processes > 1 else local).cpu()
        subset, vectors = out["subset"], out["vectors"]
        p = vectors[torch.searchsorted(subset.rows, positives).to(vectors.device)]
        h, h_rows = (hardest_negatives(queries, vectors, subset.rows, positives) if self.banks.h is not None
                     else (None, None))
        self.banks.enqueue(queries, p, positives, h, h_rows)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.banks.state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.banks.load_state_tensors(tensors)

"""The RLM's retriever gate and its state: when perplexity distillation may start moving the retriever, and
when it must stop (Algorithm 2 leaves both implicit; distilling a reader that cannot read yet destroys the
retriever, docs/rlm_toy_log.md)."""

from __future__ import annotations

import torch

from rag_train.train.schema import RLMConfig


class RetrieverGate:
    """Retriever updates start once the reader's P_a prefers the passages that contain an answer (running
    mean of its mass there, above the share of such passages, exceeds `pdist_gate`, after
    `retriever_start_step`), and stop for good if the passage embeddings collapse."""

    def __init__(self, cfg: RLMConfig, enabled: bool, accelerator):
        self.cfg = cfg
        self.enabled = enabled
        self.accelerator = accelerator  # decisions use values averaged over processes: DDP needs them equal
        self.lift = 0.0
        self.opened_at = None
        self.collapsed_at = None

    def state_dict(self) -> dict:
        """Checkpointed (`accelerator.register_for_checkpointing`): a resumed run keeps when the gate opened."""
        return {"lift": self.lift, "opened_at": self.opened_at, "collapsed_at": self.collapsed_at}

    def load_state_dict(self, state: dict) -> None:
        self.lift, self.opened_at, self.collapsed_at = state["lift"], state["opened_at"], state["collapsed_at"]

    @property
    def open(self) -> bool:
        return self.opened_at is not None and self.collapsed_at is None

    def update(self, step: int, reader_loglik: torch.Tensor, has_answer: torch.Tensor) -> bool:
        """`has_answer` [B, k]: passage k contains one of question b's answers (DPR `has_answer`)."""
        if not self.enabled or self.collapsed_at is not None:
            return False
        p_a = torch.softmax(reader_loglik.float() / self.cfg.reader_temperature, dim=-1)
        hits = has_answer.to(p_a.device).float()
        mixed = (hits.sum(-1) > 0) & (hits.sum(-1) < hits.shape[-1])  # only there can P_a discriminate
        lift = ((p_a * hits).sum(-1) - hits.mean(-1))[mixed].sum()
        totals = self.accelerator.reduce(torch.stack([lift, mixed.sum().float()]), "sum")
        if totals[1] > 0:
            self.lift = 0.9 * self.lift + 0.1 * (totals[0] / totals[1]).item()
        discriminates = self.cfg.pdist_gate == 0 or self.lift > self.cfg.pdist_gate  # 0: no gate
        if self.opened_at is None and step >= self.cfg.retriever_start_step and discriminates:
            self.opened_at = step
        return self.open

    def check_collapse(self, step: int, passages: torch.Tensor) -> float:
        """1 - mean pairwise cosine of the step's passage vectors (0 = all the same vector)."""
        unit = torch.nn.functional.normalize(passages.detach().float().reshape(-1, passages.shape[-1]), dim=-1)
        n = unit.shape[0]
        spread = 1.0 - (unit.sum(0).pow(2).sum() - n) / max(1, n * (n - 1))
        spread = self.accelerator.reduce(spread, "mean").item()
        if spread < self.cfg.min_embedding_spread and self.collapsed_at is None:
            self.collapsed_at = step
            self.accelerator.print(f"warning: retriever embeddings collapsed at step {step} (spread {spread:.4f} < "
                                   f"min_embedding_spread={self.cfg.min_embedding_spread}); retriever updates stop")
        return spread

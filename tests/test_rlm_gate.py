"""The RLM's retriever gate against hand-computed values: PDist starts only once P_a prefers the passages
that contain an answer, and a collapse of the passage embeddings stops retriever updates for good."""

import math

import torch
from accelerate import Accelerator

from rag_train.train.gate import RetrieverGate
from rag_train.train.schema import RLMConfig


def gate(threshold: float, start: int = 0) -> RetrieverGate:
    cfg = RLMConfig(pdist_gate=threshold, retriever_start_step=start, min_embedding_spread=0.1)
    return RetrieverGate(cfg, True, Accelerator(cpu=True))


def test_lift_is_the_answer_mass_above_chance_on_mixed_rows_only():
    g = gate(0.99)
    loglik = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0], [5.0, 1.0]])
    hits = torch.tensor([[True, False], [True, True], [False, False]])  # only row 0 can discriminate
    g.update(0, loglik, hits)
    # row 0: P_a = (0.75, 0.25), mass on the answer passage 0.75, chance 0.5 -> lift 0.25; EMA from 0: 0.025
    assert abs(g.lift - 0.025) < 1e-6
    assert not g.open


def test_opens_after_start_step_once_the_lift_passes_the_threshold():
    g = gate(0.2, start=3)
    good = (torch.tensor([[10.0, 0.0, 0.0, 0.0]]), torch.tensor([[True, False, False, False]]))
    opened = [g.update(step, *good) for step in range(20)]
    first = opened.index(True)
    # by hand: lift = 0.99986 - 0.25 on the one mixed row; its running mean after t updates is
    # 0.74986 (1 - 0.9^t): 0.075, 0.142, 0.203 > 0.2 at step 2, but step 3 is the first allowed
    assert first == 3 and all(opened[first:])
    unstarted = gate(0.2)
    assert [unstarted.update(step, *good) for step in range(4)] == [False, False, True, True]  # no start step: 2
    assert g.opened_at == first
    g2 = gate(0.2)  # a reader that prefers the wrong passage never opens it
    bad = (torch.tensor([[0.0, 10.0]]), torch.tensor([[True, False]]))
    assert not any(g2.update(step, *bad) for step in range(50))


def test_collapse_closes_the_gate_for_good():
    g = gate(0.0)
    assert g.update(0, torch.tensor([[1.0, 0.0]]), torch.tensor([[True, False]]))
    same = torch.ones(1, 4, 8)
    assert g.check_collapse(5, same) < 1e-6
    assert g.collapsed_at == 5 and not g.open
    assert not g.update(6, torch.tensor([[1.0, 0.0]]), torch.tensor([[True, False]]))

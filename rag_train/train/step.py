"""One training step's machinery, shared by the recipes: data order as a pure function of (seed, step) — the
global batch for step t is the same whatever the number of processes, each process takes its contiguous slice, and
resuming needs nothing but the step — stage seeding, and the optimizer step with the numerical-fault rules
(`NonFiniteGuard`, `optimizer_step`, DeepSpeed's variant) and the warm-up schedule. The run around the steps is
`train.run`."""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from rag_train.config import ConfigError
from rag_train.train.trainable import deepspeed_stage


def seed_stage(seed: int, stage: str) -> None:
    """Seed python, numpy and torch (every device) for one stage of a recipe from (train.seed, stage name). Each
    stage starts from its own seed, so its random draws (initial weights, dropout, sampling) are the same
    whether the stages before it ran in this process or were reused from disk after a kill."""
    digest = hashlib.sha256(f"{seed}:{stage}".encode()).digest()
    set_seed(int.from_bytes(digest[:4], "little") % 2**31, device_specific=False)


def global_batch(num_examples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Example indices of the global batch at `step`: epochs are seeded permutations, walked in order."""
    start = step * batch_size
    out = np.empty(batch_size, dtype=np.int64)
    filled = 0
    while filled < batch_size:
        epoch, offset = divmod(start + filled, num_examples)
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        take = min(batch_size - filled, num_examples - offset)
        out[filled : filled + take] = order[offset : offset + take]
        filled += take
    return out


def local_slice(items: np.ndarray, accelerator: Accelerator) -> np.ndarray:
    """This process's contiguous share of a global batch (sizes checked in `TrainingRun`)."""
    per_rank = len(items) // accelerator.num_processes
    return items[accelerator.process_index * per_rank : (accelerator.process_index + 1) * per_rank]


class NonFiniteGuard:
    """Numerical-fault bookkeeping for `optimizer_step`.

    A step whose task loss or encoder gradient is not finite (on any process) is skipped whole: no
    parameter, optimizer or scheduler update. A step whose auxiliary (corrector) loss or gradient is not
    finite, or whose auxiliary loss exceeds `aux_max_loss` (> 0), keeps its encoder update and drops only
    the corrector's. Both are counted, printed, logged as `skipped_steps` / `corrector_skipped_steps` and
    written into metrics.json; `max_in_a_row` such steps in a row stop the run with FloatingPointError.
    The counts are checkpointed, so a resumed run reports what an uninterrupted one would.
    """

    def __init__(self, max_in_a_row: int, aux_max_loss: float = 0.0):
        self.max_in_a_row = max_in_a_row
        self.aux_max_loss = aux_max_loss
        self.in_a_row = 0
        self.skipped = 0
        self.aux_in_a_row = 0
        self.aux_skipped = 0
        self.calls = 0  # optimizer steps attempted (= the training step after it)

    def record(self, accelerator: Accelerator, bad: bool, aux_bad: bool, why: str) -> None:
        """Count one step's outcome (decided identically on every process); raise after too many in a row."""
        self.calls += 1
        if bad:
            self.in_a_row += 1
            self.skipped += 1
            accelerator.print(f"warning: step {self.calls}: {why}; step skipped ({self.in_a_row} in a row, "
                              f"{self.skipped} in all)")
            if self.in_a_row >= self.max_in_a_row:
                raise FloatingPointError(
                    f"{self.in_a_row} consecutive steps had a non-finite loss or gradient; stopping at step "
                    f"{self.calls} (train.max_bad_steps={self.max_in_a_row}). Lower train.lr or check the data; "
                    "the last checkpoint is intact (train.resume=true continues from it).")
            return
        self.in_a_row = 0
        if aux_bad:
            self.aux_in_a_row += 1
            self.aux_skipped += 1
            accelerator.print(f"warning: step {self.calls}: {why}; corrector update skipped, encoder updated "
                              f"({self.aux_in_a_row} in a row, {self.aux_skipped} in all)")
            if self.aux_in_a_row >= self.max_in_a_row:
                raise FloatingPointError(
                    f"the corrector diverged {self.aux_in_a_row} steps in a row; stopping at step {self.calls} "
                    f"(train.max_bad_steps={self.max_in_a_row}). Lower strategy.corrector.lr or "
                    "strategy.corrector.weight; the last checkpoint is intact.")
        else:
            self.aux_in_a_row = 0

    def counts(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped, "corrector_skipped_steps": self.aux_skipped}

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped, "aux_in_a_row": self.aux_in_a_row,
                "aux_skipped": self.aux_skipped, "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.skipped = int(state["in_a_row"]), int(state["skipped"])
        self.aux_in_a_row, self.aux_skipped = int(state["aux_in_a_row"]), int(state["aux_skipped"])
        self.calls = int(state["calls"])


def _finite_norm(params: list, max_norm: float, accelerator: Accelerator) -> torch.Tensor:
    """Gradient norm of `params` (clipped to `max_norm` when > 0); non-finite if any gradient is."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if max_norm > 0:
        norm = accelerator.clip_grad_norm_(grads, max_norm)
        return torch.zeros(()) if norm is None else torch.as_tensor(norm).detach().float().cpu()  # None: DeepSpeed
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.detach().float())
                                                 for p in grads])).cpu()


def auxiliary_params(optimizer) -> list:
    """Parameters of the optimizer groups a strategy marked `auxiliary` (the corrector's)."""
    return [p for group in optimizer.param_groups if group.get("auxiliary") for p in group["params"]]


def optimizer_step(accelerator: Accelerator, loss: torch.Tensor, params: list, optimizer, scheduler,
                   guard: NonFiniteGuard, max_grad_norm: float, aux: Optional[torch.Tensor] = None,
                   backward: bool = True, on_gradients: Optional[Callable[[], None]] = None) -> bool:
    """Backward of `loss` (+ `aux`), clip, step — with the numerical-fault rules of `NonFiniteGuard`.

    `backward=False`: the caller has already back-propagated (several backward passes per step: the
    micro-batches of `train.batching`), and `loss` / `aux` are only checked. `on_gradients()` runs between
    the backward and the clipping (per-tower gradient norms); not under DeepSpeed, whose engine steps inside
    its backward.

    `aux` is an auxiliary loss computed from detached encoder outputs (the corrector's): its gradient
    reaches only the optimizer groups marked `auxiliary`. Those are left out of the clipping norm, so a
    diverging corrector can neither poison nor rescale the encoder's gradient, and when `aux` (or its
    gradient) is not finite, or above `guard.aux_max_loss`, only those groups skip the update. Every process runs the
    backward (DDP needs it) and the decision is reduced over processes, so all of them take the same one.
    Under DeepSpeed see `_deepspeed_step`."""
    if deepspeed_stage(accelerator) is not None:
        if not backward:
            raise ConfigError("several backward passes per optimizer step (batching.micro_batches > 1) cannot run "
                              "under DeepSpeed, whose engine steps inside each backward; use batching.name=plain")
        return _deepspeed_step(accelerator, loss, guard, aux)
    aux_params = auxiliary_params(optimizer)
    aux_ids = {id(p) for p in aux_params}
    main_params = [p for p in params if id(p) not in aux_ids]
    if backward:
        accelerator.backward(loss if aux is None else loss + aux)
    if on_gradients is not None:
        on_gradients()
    main_norm = _finite_norm(main_params, max_grad_norm, accelerator)
    aux_norm = _finite_norm(aux_params, 0.0, accelerator) if aux_params else torch.zeros(())  # checked, not clipped
    aux_value = aux.detach().float().cpu() if aux is not None else torch.zeros(())
    flags = torch.tensor([
        not torch.isfinite(loss.detach()).all().item(),
        not bool(torch.isfinite(main_norm)),
        not bool(torch.isfinite(aux_value)),
        not bool(torch.isfinite(aux_norm)),
        guard.aux_max_loss > 0 and bool(aux_value > guard.aux_max_loss),
    ], dtype=torch.float32, device=accelerator.device)
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, reduction="sum")
    bad_loss, bad_grad, bad_aux_loss, bad_aux_grad, aux_exploding = (bool(v > 0) for v in flags.tolist())
    if getattr(accelerator, "scaler", None) is not None:  # fp16: the loss scaler skips inf-gradient steps itself
        bad_grad = bad_aux_grad = False
    bad, aux_bad = bad_loss or bad_grad, bad_aux_loss or bad_aux_grad or aux_exploding
    why = ("non-finite loss" if bad_loss else "non-finite gradient" if bad_grad
           else "non-finite corrector loss or gradient" if bad_aux_loss or bad_aux_grad
           else f"corrector loss above strategy.corrector.max_loss={guard.aux_max_loss}")
    guard.record(accelerator, bad, aux_bad, why)
    if not bad:
        if aux_bad:
            for p in aux_params:
                p.grad = None  # AdamW leaves parameters without a gradient (and their moments) untouched
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return not bad


def _deepspeed_step(accelerator: Accelerator, loss: torch.Tensor, guard: NonFiniteGuard,
                    aux: Optional[torch.Tensor]) -> bool:
    """`optimizer_step` under DeepSpeed. The engine updates inside `accelerator.backward` (engine.backward +
    engine.step, clipping by `train.max_grad_norm`), so gradients cannot be inspected before the update and
    the rules apply to the losses instead, decided on every process alike: a non-finite task loss skips the
    step (no backward); a non-finite corrector loss, or one above `aux_max_loss`, is left out of the backward.
    Its parameters then get a zero gradient, which AdamW still applies (moments), unlike the DDP path where
    they are left untouched; the same holds for any part without a gradient in a step (the RLM's retriever
    before its gate opens). A non-finite gradient norm after the update stops the run: the weights are lost
    but the last checkpoint is intact (fp16 loss scaling skips such steps inside DeepSpeed)."""
    aux_value = aux.detach().float() if aux is not None else torch.zeros((), device=loss.device)
    flags = torch.tensor([
        not torch.isfinite(loss.detach()).all().item(),
        not bool(torch.isfinite(aux_value)),
        guard.aux_max_loss > 0 and bool(aux_value > guard.aux_max_loss),
    ], dtype=torch.float32, device=accelerator.device)
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, reduction="sum")
    bad, bad_aux_loss, aux_exploding = (bool(v > 0) for v in flags.tolist())
    aux_bad = bad_aux_loss or aux_exploding
    why = ("non-finite loss" if bad else "non-finite corrector loss or gradient" if bad_aux_loss
           else f"corrector loss above strategy.corrector.max_loss={guard.aux_max_loss}")
    guard.record(accelerator, bad, aux_bad, why)
    if bad:
        return False
    accelerator.backward(loss if aux is None or aux_bad else loss + aux)
    norm = accelerator.deepspeed_engine_wrapped.engine.get_global_grad_norm()
    if norm is not None and not math.isfinite(float(norm)):
        raise FloatingPointError(
            f"non-finite gradient norm at step {guard.calls} under DeepSpeed, which had already applied the update; "
            "stopping. Lower train.lr or check the data; the last checkpoint is intact (train.resume=true).")
    return True


def linear_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then constant, the schedule both papers' recipes use by default."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))

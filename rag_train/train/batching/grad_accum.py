"""`batching.name=grad_accum`: K micro-batches, each one's loss over its OWN passages only (its own subset: its
positives, the strategy's negatives for its questions), back-propagated with weight 1/K; one optimizer step.

Seed 002's weak baseline: the gradient is the mean of K small-batch gradients, not the big batch's (each query
sees 1/K of the negatives). Takes every strategy: each micro-batch is an Algorithm-1 batch of its own."""

from __future__ import annotations

from rag_train.train.batching.base import (
    BatchingOption,
    MicroBatch,
    MicroBatchesConfig,
    StepResult,
    mean_logged,
    my_passages,
    propose,
    register,
    subset_losses,
    synced_on_last,
)


@register
class GradAccum(BatchingOption):
    """K micro-batches, each one's loss over its own passages only, averaged (not the big batch's gradient:
    fewer negatives per query)."""

    name = "grad_accum"
    config = MicroBatchesConfig
    min_micro_batches = 2  # K = 1 is plain

    def step(self, micro_batches: list[MicroBatch]) -> StepResult:
        parts, count = self.parts, len(micro_batches)
        losses, auxes, logged, columns = [], [], [], 0
        for k, batch in enumerate(micro_batches):
            subset = propose(parts, batch)
            with synced_on_last(parts, k, count):
                out = parts.trainable(subset_losses, parts, batch.questions, my_passages(parts, subset), subset)
                total = out["loss"] if out["aux"] is None else out["loss"] + out["aux"]
                parts.accelerator.backward(total / count)
            losses.append(out["loss"].detach())
            if out["aux"] is not None:
                auxes.append(out["aux"].detach())
            logged.append(out["logged"])
            columns += len(subset.rows)
        return StepResult(sum(losses) / count, sum(auxes) / count if auxes else None, backward_done=True,
                          columns=columns / count, logged=mean_logged(logged))

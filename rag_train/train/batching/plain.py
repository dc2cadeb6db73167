"""`batching.name=plain`: the whole global batch in one forward, Algorithm 1 as seed 000 writes it.

The recipe's `optimizer_step` back-propagates the returned loss (so DeepSpeed, which steps inside its
backward, runs this option). Takes every strategy."""

from __future__ import annotations

from rag_train.train.batching.base import (
    BatchingOption,
    MicroBatch,
    StepResult,
    my_passages,
    propose,
    register,
    subset_losses,
)


@register
class Plain(BatchingOption):
    """The whole batch in one forward (K = 1, no bank): the in-batch / subset softmax of seed 000."""

    name = "plain"
    own_backward = False

    def step(self, micro_batches: list[MicroBatch]) -> StepResult:
        (batch,) = micro_batches
        subset = propose(self.parts, batch)  # 1. the shared subset S
        out = self.parts.trainable(subset_losses, self.parts, batch.questions, my_passages(self.parts, subset), subset)
        return StepResult(out["loss"], out["aux"], backward_done=False, columns=len(subset.rows), logged=out["logged"])

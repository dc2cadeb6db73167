"""`batching.name=grad_cache`: the exact full-batch gradient of Algorithm 1 in K chunks (Gao et al. 2021).

1. The strategy's subset S for the whole global batch (as `plain`).
2. f(x) of each of the K query chunks and g(y) of each chunk of this process's share of S, WITHOUT gradient,
   each chunk's RNG state kept (dropout), as GradCache's RandContext does.
3. The full-batch task loss on those representations (S gathered from every process, so under DDP the
   negatives are the global batch's), back-propagated to the representations only: the cached
   d loss / d f(x) and d loss / d g(y) (the gather's backward sums what every process's queries send to this
   process's passages).
4. Each chunk re-encoded WITH gradient under its saved RNG state and back-propagated with its cached gradient
   (<rep, cached grad> as the surrogate): the sum over chunks is the full-batch gradient. The strategy's
   auxiliary (corrector) loss, a function of detached vectors, joins the last chunk's backward.

Peak activation memory is one chunk's; the price is a second forward. Takes every strategy (the task loss is
any function of the scores)."""

from __future__ import annotations

import torch

from rag_train.losses import retrieval_scores
from rag_train.train.batching.base import (
    BatchingOption,
    MicroBatch,
    MicroBatchesConfig,
    StepResult,
    propose,
    register,
    rng_devices,
    synced_on_last,
)
from rag_train.train.passages import gather_with_grad, my_share


class RandContext:
    """The RNG state (CPU and the current CUDA device) at construction, restored for the duration of a `with`;
    the global generators continue afterwards as if the block had not run."""

    def __init__(self, device: torch.device):
        self.devices = rng_devices(device)
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        self._fork = None

    def __enter__(self) -> None:
        self._fork = torch.random.fork_rng(devices=self.devices)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(state, device)

    def __exit__(self, *exc) -> None:
        self._fork.__exit__(*exc)
        self._fork = None


def _encode(model: torch.nn.Module, questions: list[str], passages: list[dict]):
    """(f(x), g(y)) in one call; g(y) None for an empty passage chunk."""
    if passages:
        return model(questions, passages)
    return model.encode_queries(questions), None


def _reencode(prepared: torch.nn.Module, questions: list[str], passages: list[dict], query_grad: torch.Tensor,
              passage_grad: torch.Tensor, aux_inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepared module's forward for one chunk: the surrogate whose gradient is the cached one."""
    queries, part = _encode(prepared.retriever, questions, passages)
    surrogate = (queries * query_grad.to(queries.dtype)).sum()
    if part is not None and part.requires_grad:
        surrogate = surrogate + (part * passage_grad.to(part.dtype)).sum()
    aux = None if aux_inputs is None else aux_inputs[0].auxiliary_loss(*aux_inputs[1:])
    return surrogate if aux is None else surrogate + aux, aux


@register
class GradCache(BatchingOption):
    """Representations of all K chunks without gradient, the full-batch loss on them, its gradient per
    representation cached, each chunk re-encoded with gradient: exactly the full-batch gradient."""

    name = "grad_cache"
    config = MicroBatchesConfig
    min_micro_batches = 2  # K = 1 is plain

    def step(self, micro_batches: list[MicroBatch]) -> StepResult:
        parts, acc, count = self.parts, self.parts.accelerator, len(micro_batches)
        questions = [q for batch in micro_batches for q in batch.questions]
        whole = MicroBatch(questions, torch.cat([batch.positives for batch in micro_batches]))
        subset = propose(parts, whole)  # 1.
        rows = my_share(subset.rows, acc)
        # passage chunks: empty ones (a share smaller than K) go first, so the last (synced) forward uses both towers
        chunks = torch.tensor_split(torch.arange(len(rows)), count)
        chunks = [c for c in chunks if len(c) == 0] + [c for c in chunks if len(c)]
        passage_chunks = [parts.corpus.passages(rows[c].tolist()) for c in chunks]

        # 2. representations without gradient, each chunk's RNG state kept for its re-encoding
        states, query_reps, passage_reps = [], [], []
        with torch.no_grad(), acc.autocast():  # the same precision as the prepared forward
            for batch, passages in zip(micro_batches, passage_chunks):
                states.append(RandContext(acc.device))
                queries, part = _encode(parts.model, batch.questions, passages)
                query_reps.append(queries)
                if part is not None:
                    passage_reps.append(part)
        query_leaf = torch.cat(query_reps).detach().requires_grad_()
        passage_leaf = torch.cat(passage_reps).detach().requires_grad_()

        # 3. the full-batch loss on the representations; its gradient per representation is the cache
        vectors = gather_with_grad(passage_leaf, len(subset.rows), acc)
        scores = retrieval_scores(query_leaf, vectors)
        loss, logged = parts.strategy.task_loss(scores, subset)
        loss.backward()
        query_grads = torch.split(query_leaf.grad, [len(b.questions) for b in micro_batches])
        passage_grads = torch.split(passage_leaf.grad, [len(c) for c in chunks])
        aux_inputs = (parts.strategy, query_leaf.detach(), subset.rows, vectors.detach(), scores.detach())

        # 4. each chunk again, with gradient, under its saved RNG state
        aux = None
        for k, (batch, passages) in enumerate(zip(micro_batches, passage_chunks)):
            last = k == count - 1
            with synced_on_last(parts, k, count), states[k]:
                surrogate, chunk_aux = parts.trainable(_reencode, batch.questions, passages, query_grads[k],
                                                       passage_grads[k], aux_inputs if last else None)
                acc.backward(surrogate)
            if last:
                aux = None if chunk_aux is None else chunk_aux.detach()
        return StepResult(loss.detach(), aux, backward_done=True, columns=len(subset.rows), logged=logged)

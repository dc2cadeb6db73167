"""Embedding corpus rows with the current passage encoder, without gradient, sharded over processes."""

from __future__ import annotations

import numpy as np
import torch
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from rag_train.buffer.distributed import shard_range
from rag_train.data.corpus import Corpus


@torch.inference_mode()
def embed_rows(model: nn.Module, corpus: Corpus, rows: np.ndarray, batch_size: int, device: torch.device,
               progress: bool = False) -> torch.Tensor:
    """[len(rows), D] fp32 vectors of `corpus` rows from `model.encode_passages` (a DualEncoder), in eval
    mode; batches are length-sorted (less padding) and scattered back to the order of `rows`."""
    rows = np.asarray(rows, dtype=np.int64)
    was_training = model.training
    model.eval()
    out = torch.empty(len(rows), model.dim, device=device)
    order = np.argsort(corpus.byte_lengths()[rows], kind="stable") if len(rows) else rows
    bar = tqdm(total=len(rows), desc="embed", unit="psg", disable=not progress, leave=False)
    for start in range(0, len(rows), batch_size):
        picked = order[start : start + batch_size]
        out[torch.as_tensor(picked, device=device)] = model.encode_passages(corpus.passages(rows[picked])).float().to(device)
        bar.update(len(picked))
    bar.close()
    model.train(was_training)
    return out


def embed_local_shard(model: nn.Module, corpus: Corpus, accelerator: Accelerator, batch_size: int) -> tuple[torch.Tensor, int]:
    """This process's contiguous share of the whole corpus, embedded now: (vectors, first global row)."""
    start, end = shard_range(len(corpus), accelerator.process_index, accelerator.num_processes)
    vectors = embed_rows(model, corpus, np.arange(start, end), batch_size, accelerator.device,
                         progress=accelerator.is_local_main_process)
    return vectors, start

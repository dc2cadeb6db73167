"""Embedding corpus rows with the current passage encoder, without gradient, sharded over processes."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import numpy as np
import torch
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from rag_train.buffer.distributed import shard_range
from rag_train.data.corpus import Corpus


def autocast_for(device: torch.device):
    """bf16 (fp16 where bf16 is missing) autocast for encoding on CUDA; full precision elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)


def length_sorted_order(lengths: np.ndarray) -> np.ndarray:
    """Positions sorted by length (stable, so equal lengths keep row order): batches pad little."""
    return np.argsort(lengths, kind="stable")


@torch.inference_mode()
def embed_rows(model: nn.Module, corpus: Corpus, rows: np.ndarray, batch_size: int, device: torch.device,
               progress: bool = False, on_batch: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """[len(rows), D] fp32 vectors of `corpus` rows from `model.encode_passages` (a DualEncoder), in eval
    mode; batches are length-sorted (less padding) and scattered back to the order of `rows`."""
    rows = np.asarray(rows, dtype=np.int64)
    was_training = model.training
    model.eval()
    model_device = next(model.parameters()).device
    out = torch.empty(len(rows), model.dim, device=device)
    order = length_sorted_order(corpus.byte_lengths()[rows]) if len(rows) else rows
    bar = tqdm(total=len(rows), desc="embed", unit="psg", disable=not progress, leave=False)
    for start in range(0, len(rows), batch_size):
        picked = order[start : start + batch_size]
        with autocast_for(model_device):
            vectors = model.encode_passages(corpus.passages(rows[picked]))
        out[torch.as_tensor(picked, device=device)] = vectors.float().to(device)
        bar.update(len(picked))
        if on_batch is not None:
            on_batch(len(picked))
    bar.close()
    model.train(was_training)
    return out


def embed_local_shard(model: nn.Module, corpus: Corpus, accelerator: Accelerator, batch_size: int) -> tuple[torch.Tensor, int]:
    """This process's contiguous share of the whole corpus, embedded now: (vectors, first global row)."""
    start, end = shard_range(len(corpus), accelerator.process_index, accelerator.num_processes)
    vectors = embed_rows(model, corpus, np.arange(start, end), batch_size, accelerator.device,
                         progress=accelerator.is_local_main_process)
    return vectors, start

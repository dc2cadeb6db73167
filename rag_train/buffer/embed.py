"""The one path that embeds corpus passages g(y) without gradient: buffer build, exhaustive refresh,
evaluation, the warm start's retrieval metrics and export all call `embed_rows`.

The host side is built not to starve the device (transformers' per-token list -> tensor conversion on
the main thread kept an H100 at 6%):
  * a torch `DataLoader` whose worker processes (`num_workers`, 0 = in this process) read passages and
    tokenise them with the Rust tokenizer's batch API (`tokenizers.Tokenizer.encode_batch_fast`) straight
    into integer arrays;
  * rows are sorted by byte length, cut into chunks, and each chunk is split into batches of similar token
    length under a row cap (`batch_size`) and a padded-token budget (`batch_tokens`);
  * with a token cache of the corpus (buffer/tokens.py, registered by `use_token_cache`, as a training run does),
    the token ids are read from it instead: the same batches and the same bytes, without tokenising again;
  * on CUDA: pinned host memory, asynchronous host-to-device copies, bf16 autocast, and device-to-host
    copies of the vectors that are waited for a few batches later.
The batch plan depends only on the rows and the tokenizer (not on worker timing), so the same rows give
the same bytes whatever `num_workers` is.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol

import numpy as np
import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from rag_train.buffer.distributed import shard_range
from rag_train.buffer.store import Buffer, definition_fingerprint
from rag_train.data.corpus import Corpus
from rag_train.models.attention import pass_attention, t5_attention

CHUNK_BATCHES = 8  # rows a worker tokenises at once: this many row caps (amortises its per-call overhead)
PENDING_COPIES = 4  # device -> host copies in flight before the oldest is waited for
# a pass of fewer batches runs in the main process: starting workers and shipping their items cost more than the
# overlap gives back (H200, 8 workers: 1-32 batches of 1,024 took 1.1-2x the in-process time, 64 batches 0.9x;
# 2-core CPU, 1 worker, batches of 256: 16 batches 1.14x, 64 batches 0.92x; docs/generated/gpu_report.md). Per-step
# embeds (negative cache, SNM, small refreshes) are such passes.
WORKER_MIN_BATCHES = 32


def autocast_for(device: torch.device):
    """bf16 (fp16 where bf16 is missing) autocast for encoding on CUDA; full precision elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)


def length_sorted_order(lengths: np.ndarray) -> np.ndarray:
    """Positions sorted by length (stable, so equal lengths keep row order): batches pad little."""
    return np.argsort(lengths, kind="stable")


class PassageTokenizer:
    """The passage tower's tokenizer as a bare Rust `tokenizers.Tokenizer` (picklable, so it travels to
    DataLoader workers), set up exactly as sentence-transformers calls it (special tokens added, truncation
    'longest_first' at `max_length` on the tokenizer's truncation side) but returning numpy arrays."""

    def __init__(self, hf_tokenizer, max_length: int):
        from tokenizers import Tokenizer

        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(hf_tokenizer).__name__} has no Rust backend (a 'fast' tokenizer with "
                            "tokenizer.json is needed to embed passages); save the model with a fast tokenizer")
        self.backend = Tokenizer.from_str(backend.to_str())  # a copy: the tower's own settings stay untouched
        self.backend.no_padding()
        self.backend.enable_truncation(max_length, stride=0, strategy="longest_first",
                                       direction=getattr(hf_tokenizer, "truncation_side", "right"))
        self.pad_id = int(hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else 0)
        self.type_ids = "token_type_ids" in getattr(hf_tokenizer, "model_input_names", ())
        self.max_length = max_length

    @classmethod
    def for_passages(cls, model: nn.Module) -> "PassageTokenizer":
        """The tokenizer of a DualEncoder's passage tower at its `max_passage_length`."""
        return cls(model.passage_encoder[0].tokenizer, model.max_passage_length)

    def encode(self, texts: list[str]) -> tuple[list[list[int]], np.ndarray]:
        """(token ids of each text, int64 lengths); no padding. The ids come back from Rust as lists."""
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # _fast: no offsets
        ids = [encoding.ids for encoding in encode(texts, add_special_tokens=True)]
        return ids, np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer's definition, as `store.vectors_fingerprint` takes it (not of the truncation and
        padding set here: the token cache records `max_length` and `truncation_side` as fields of their own)."""
        return definition_fingerprint(self.backend.to_str())

    @property
    def truncation_side(self) -> str:
        return self.backend.truncation["direction"]

    def features(self, ids: list[list[int]], lengths: np.ndarray) -> dict[str, torch.Tensor]:
        """Right-padded input_ids / attention_mask (/ token_type_ids) of the texts with token ids `ids`."""
        padded = np.full((len(ids), int(lengths.max())), self.pad_id, dtype=np.int64)
        for row, (tokens, length) in enumerate(zip(ids, lengths)):
            padded[row, :length] = tokens  # one C-level copy per text, no per-token Python
        return self.collate(padded, lengths)

    def collate(self, padded: np.ndarray, lengths: np.ndarray) -> dict[str, torch.Tensor]:
        """The features of int64 ids already right-padded with `pad_id` to the longest of `lengths`."""
        mask = np.arange(padded.shape[1]) < lengths[:, None]
        out = {"input_ids": torch.from_numpy(padded), "attention_mask": torch.from_numpy(mask.astype(np.int64))}
        if self.type_ids:  # single sequences: all segment 0, as the HF tokenizer returns them
            out["token_type_ids"] = torch.zeros_like(out["input_ids"])
        return out


class TokenIds(Protocol):
    """What a pass reads token ids from: buffer/tokens.py's `TokenCache` (not imported here: it imports this module)."""

    corpus_fingerprint: str

    def differences(self, tokenizer: PassageTokenizer) -> list[str]: ...

    def check(self, corpus: Corpus, tokenizer: PassageTokenizer) -> None: ...

    def lengths(self, rows: np.ndarray) -> np.ndarray: ...

    def padded(self, rows: np.ndarray, pad_id: int) -> np.ndarray: ...


_TOKEN_CACHES: list[TokenIds] = []  # registered by `use_token_cache`, newest last


@contextlib.contextmanager
def use_token_cache(cache: TokenIds) -> Iterator[TokenIds]:
    """Inside, every `embed_rows` over the cache's corpus with its tokenizer and max length reads the ids from it:
    a training run registers its cache once instead of handing it to every pass (buffer build, refreshes,
    re-embedding strategies, evaluation)."""
    _TOKEN_CACHES.append(cache)
    try:
        yield cache
    finally:
        _TOKEN_CACHES.remove(cache)


def registered_token_cache(corpus: Corpus, tokenizer: PassageTokenizer) -> Optional[TokenIds]:
    """The newest registered cache made for `corpus` by `tokenizer` (definition, max length, truncation side)."""
    for cache in reversed(_TOKEN_CACHES):
        if cache.corpus_fingerprint == corpus.fingerprint and not cache.differences(tokenizer):
            return cache
    return None


def plan_batches(lengths: np.ndarray, batch_size: int, batch_tokens: int) -> list[np.ndarray]:
    """Positions of `lengths`, sorted by length, cut into batches of at most `batch_size` rows whose padded
    size (rows x longest) stays within `batch_tokens` (a row longer than the budget is a batch of its own)."""
    order = np.argsort(lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        end = start + 1
        while end < len(order) and end - start < batch_size and (end + 1 - start) * lengths[order[end]] <= batch_tokens:
            end += 1
        batches.append(order[start:end])
        start = end
    return batches


@dataclass
class _Chunks(Dataset):
    """Item i: the tokenised batches of chunk i of `rows` (in length-sorted order), each a dict of tensors
    with `positions` (indices into `rows`, where its vectors go); with `tokens`, the ids come from that cache."""

    corpus: Corpus
    rows: np.ndarray
    chunks: list[np.ndarray]  # positions into `rows`, per chunk
    tokenizer: PassageTokenizer
    batch_size: int
    batch_tokens: int
    tokens: Optional[TokenIds] = None

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> list[dict[str, torch.Tensor]]:
        from rag_train.models.retriever import format_passage

        positions = self.chunks[index]
        if self.tokens is None:
            texts = [format_passage(p) for p in self.corpus.passages(self.rows[positions])]
            ids, lengths = self.tokenizer.encode(texts)
        else:
            lengths = self.tokens.lengths(self.rows[positions])
        batches = []
        for picked in plan_batches(lengths, self.batch_size, self.batch_tokens):
            if self.tokens is None:
                batch = self.tokenizer.features([ids[i] for i in picked], lengths[picked])
            else:
                padded = self.tokens.padded(self.rows[positions[picked]], self.tokenizer.pad_id)
                batch = self.tokenizer.collate(padded, lengths[picked])
            batch["positions"] = torch.from_numpy(positions[picked])
            batches.append(batch)
        return batches


def _quiet_worker(_: int) -> None:
    """Workers tokenise on one thread each (the workers are the parallelism) and skip the fork warning."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)


def chunk_batches(rows: int, batch_size: int, num_workers: int) -> int:
    """Batches per worker item: CHUNK_BATCHES, or fewer when the rows would not give every worker two items (a
    few big items leave the workers idle while the device waits for the first one: at 4,096 rows, batch 1,024 and 8
    workers one 8-batch item made embed_rows 0.4x SentenceTransformer.encode on an H100,
    docs/generated/gpu_report.md)."""
    if num_workers <= 0:
        return CHUNK_BATCHES
    return max(1, min(CHUNK_BATCHES, -(-rows // (batch_size * 2 * num_workers))))


def passage_loader(corpus: Corpus, rows: np.ndarray, tokenizer: PassageTokenizer, batch_size: int,
                   batch_tokens: int, num_workers: int, pin_memory: bool,
                   tokens: Optional[TokenIds] = None) -> DataLoader:
    """A DataLoader over the tokenised, length-bucketed batches of `rows` (one item = one chunk's batches); in the
    main process below WORKER_MIN_BATCHES batches, whatever `num_workers` says, and always with a token cache
    `tokens` (reading and padding cached ids is a vectorised gather: workers would cost more to start than it
    takes). The chunks follow `num_workers` either way, so a cached pass makes the batches of an uncached one."""
    order = length_sorted_order(corpus.byte_lengths()[rows]) if len(rows) else np.zeros(0, dtype=np.int64)
    if len(rows) < WORKER_MIN_BATCHES * batch_size:
        num_workers = 0
    step = batch_size * chunk_batches(len(rows), batch_size, num_workers)
    chunks = [order[start: start + step] for start in range(0, len(order), step)]
    dataset = _Chunks(corpus, rows, chunks, tokenizer, batch_size, batch_tokens, tokens)
    workers = 0 if tokens is not None else min(num_workers, len(chunks))
    # its own generator: iterating a DataLoader draws a seed, which must not move the global RNG of training
    return DataLoader(dataset, batch_size=None, shuffle=False, num_workers=workers, pin_memory=pin_memory,
                      worker_init_fn=_quiet_worker if workers else None, generator=torch.Generator(),
                      prefetch_factor=4 if workers else None)


@torch.inference_mode()
def embed_rows(model: nn.Module, corpus: Corpus, rows: np.ndarray, batch_size: int, device: torch.device,
               progress: bool = False, on_batch: Optional[Callable[[int], None]] = None, num_workers: int = 0,
               batch_tokens: Optional[int] = None, tokens: Optional[TokenIds] = None) -> torch.Tensor:
    """[len(rows), D] fp32 vectors g(y) of `corpus` rows, in the order of `rows`, on `device`, from the passage
    tower of `model` (a DualEncoder) in eval mode; the same vectors as `model.encode_passages` (to float
    rounding: batches differ). `batch_tokens` defaults to `batch_size` x `max_passage_length` (no extra cap).
    Token ids come from `tokens`, else from a registered cache of this corpus and tokenizer (`use_token_cache`),
    else from tokenising now: the same bytes each way."""
    rows = np.asarray(rows, dtype=np.int64)
    was_training = model.training
    model.eval()
    model_device = next(model.parameters()).device
    on_cuda = model_device.type == "cuda"
    tokenizer = PassageTokenizer.for_passages(model)
    if tokens is not None:
        tokens.check(corpus, tokenizer)
    elif _TOKEN_CACHES:
        tokens = registered_token_cache(corpus, tokenizer)
    budget = batch_tokens or batch_size * tokenizer.max_length
    loader = passage_loader(corpus, rows, tokenizer, batch_size, budget, num_workers, pin_memory=on_cuda,
                            tokens=tokens)
    out = torch.empty(len(rows), model.dim, device=device)
    pending: collections.deque = collections.deque()  # (positions, host vectors, copy-done event)

    def land(positions, vectors, done=None) -> None:
        if done is not None:
            done.synchronize()
        out[positions.to(out.device)] = vectors.to(out.device)

    bar = tqdm(total=len(rows), desc="embed", unit="psg", disable=not progress, leave=False)
    # the towers' T5s run the pass's kernel (`retriever.encoder_kernel`: FlexAttention on CUDA, eager on CPU)
    with t5_attention(model, pass_attention(model.encoder_kernel, model_device)):
        for chunk in loader:
            for batch in chunk:
                positions = batch.pop("positions")
                features = {name: tensor.to(model_device, non_blocking=True) for name, tensor in batch.items()}
                with autocast_for(model_device):
                    vectors = model.encode_passage_features(features).float()
                if on_cuda and out.device.type == "cpu":  # copy back asynchronously, wait for it a few batches later
                    done = torch.cuda.Event()
                    pending.append((positions, vectors.to("cpu", non_blocking=True), done))
                    done.record()
                    if len(pending) > PENDING_COPIES:
                        land(*pending.popleft())
                else:
                    land(positions, vectors)
                bar.update(len(positions))
                if on_batch is not None:
                    on_batch(len(positions))
    while pending:
        land(*pending.popleft())
    bar.close()
    model.train(was_training)
    return out


def embed_local_shard(model: nn.Module, corpus: Corpus, accelerator: Accelerator, batch_size: int,
                      num_workers: int = 0, batch_tokens: Optional[int] = None) -> tuple[torch.Tensor, int]:
    """This process's contiguous share of the whole corpus, embedded now: (vectors, first global row)."""
    start, end = shard_range(len(corpus), accelerator.process_index, accelerator.num_processes)
    vectors = embed_rows(model, corpus, np.arange(start, end), batch_size, accelerator.device,
                         progress=accelerator.is_local_main_process, num_workers=num_workers,
                         batch_tokens=batch_tokens)
    return vectors, start


def buffer_local_shard(directory: Path, accelerator: Accelerator) -> tuple[torch.Tensor, int]:
    """The same share as `embed_local_shard`, read from the stale buffer at `directory` instead of embedded:
    (vectors, first global row); fp32 on CPU, the buffer's dtype on an accelerator (as the stale search)."""
    buffer = Buffer.open(directory)
    start, end = shard_range(buffer.rows, accelerator.process_index, accelerator.num_processes)
    rows = buffer.tensor(start, end)
    device = accelerator.device
    return rows.to(device, torch.float32 if device.type == "cpu" else rows.dtype), start


class CorpusPasses:
    """The whole-corpus embedding passes a run makes, each with why, rows and seconds: printed as they end
    and kept for metrics.json, so a run's cost in corpus passes is visible (docs/scale.md)."""

    def __init__(self, printer: Callable[[str], None] = print):
        self.printer = printer
        self.records: list[dict] = []

    @contextlib.contextmanager
    def timed(self, reason: str, rows: int):
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self.records.append({"reason": reason, "rows": rows, "seconds": round(seconds, 2)})
        self.printer(f"corpus pass {len(self.records)}: {reason}: {rows} rows in {seconds:.1f} s "
                     f"({rows / max(seconds, 1e-9):.0f} passages/s)")

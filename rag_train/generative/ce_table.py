"""The contextualized embedding table (CE) of Np Decoding, built once by an encoder over the targets and kept.

Build: the CE encoder (a T5 encoder, eval mode, no gradient) reads each target in its context
(`targets.context_inputs`: identifier tokens, end token, passage text); the outputs at the identifier's
positions and at its end token are that target's occurrences, one vector each. Reduce (the preview of seed 003
omits its Section 3.5; this is our reading, docs/generative_retrieval.md): the occurrences of each vocabulary
token are clustered by k-means into at most `clusters_per_token` centroids, which become the CE rows of that
token; a token with fewer occurrences keeps them all. A target's output path is then the row of each of its
occurrences' clusters, ending with the row of its end token. Row 0 is reserved for the decoder start (the pad
token, zero vector) and never a label.

Store: the rows as a buffer (`rag_train.buffer.store`: manifest, fp32 shard, sha256), `model_fingerprint` = the
encoder's weights + the build settings, `corpus_fingerprint` = the targets'; the row -> token map and the paths
are side files whose sha256 the manifest records. A folder is named by both fingerprints, so an identical
build is found and reused, and a rebuild (ASYNC) never overwrites an earlier table.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from rag_train.buffer.store import MANIFEST, Buffer, BufferError, write_shard
from rag_train.data.corpus import Corpus
from rag_train.generative.targets import Targets, context_inputs
from rag_train.io import sha256_file

START_ROW = 0
SIDE_FILES = ("row_token.npy", "path_rows.npy", "path_offsets.npy")


@dataclass
class CETable:
    vectors: torch.Tensor  # [R, d] fp32; row 0 = decoder start (zeros)
    row_token: torch.Tensor  # [R] vocabulary id of each row (row 0: pad)
    paths: list[list[int]]  # per target: its tokens' rows in its own context, then its end row
    directory: Optional[Path] = None

    def end_rows(self, eos_token_id: int) -> list[int]:
        return torch.nonzero(self.row_token == eos_token_id).flatten().tolist()


def encoder_fingerprint(encoder: torch.nn.Module, **settings) -> str:
    """sha256 of the encoder's weights (name, shape, bytes) and the build settings."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for name, tensor in sorted(encoder.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def contextual_occurrences(encoder: torch.nn.Module, targets: Targets, corpus: Corpus, tokenizer, length: int,
                           batch_size: int, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder outputs at every target's identifier positions and its end token, target by target:
    ([occurrences, d] fp32 on CPU, [occurrences] vocabulary ids). The encoder runs in eval mode."""
    was_training = encoder.training
    encoder.eval()
    device = next(encoder.parameters()).device
    pad = tokenizer.pad_token_id
    vectors, tokens = [], []
    bar = tqdm(total=len(targets), desc="CE encoder", unit="target", disable=not progress, leave=False)
    for start in range(0, len(targets), batch_size):
        indices = range(start, min(start + batch_size, len(targets)))
        inputs = context_inputs(targets, corpus, tokenizer, indices, length)
        width = max(map(len, inputs))
        ids = torch.full((len(inputs), width), pad, dtype=torch.long)
        for j, row in enumerate(inputs):
            ids[j, : len(row)] = torch.as_tensor(row)
        ids = ids.to(device)
        states = encoder(input_ids=ids, attention_mask=(ids != pad).long()).last_hidden_state.float().cpu()
        for j, i in enumerate(indices):
            kept = len(targets.tokens[i]) + 1  # identifier tokens + end token
            vectors.append(states[j, :kept])
            tokens.append(ids[j, :kept].cpu())
        bar.update(len(inputs))
    bar.close()
    encoder.train(was_training)
    return torch.cat(vectors), torch.cat(tokens)


def reduce_rows(vectors: torch.Tensor, tokens: torch.Tensor, clusters_per_token: int, iters: int, seed: int,
                pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k-means per vocabulary token: (CE rows [R, d], row -> token [R], occurrence -> row [occurrences]).
    Row 0 is the decoder start; `clusters_per_token=0` keeps every occurrence as its own row."""
    import faiss

    dim = vectors.shape[1]
    rows = [torch.zeros(1, dim)]
    row_token = [torch.tensor([pad_token_id])]
    occurrence_row = torch.empty(len(tokens), dtype=torch.long)
    order = torch.argsort(tokens, stable=True)
    values, counts = torch.unique_consecutive(tokens[order], return_counts=True)
    next_row = 1
    for token, members in zip(values.tolist(), torch.split(order, counts.tolist())):
        x = vectors[members]
        if clusters_per_token == 0 or len(members) <= clusters_per_token:
            centroids, assigned = x, torch.arange(len(members))
        else:
            points = np.ascontiguousarray(x.numpy(), dtype=np.float32)
            kmeans = faiss.Kmeans(dim, clusters_per_token, niter=iters, seed=seed, verbose=False,
                                  min_points_per_centroid=1)
            kmeans.train(points)
            _, nearest = kmeans.index.search(points, 1)
            centroids, assigned = torch.from_numpy(kmeans.centroids.copy()), torch.from_numpy(nearest[:, 0]).long()
        rows.append(centroids)
        row_token.append(torch.full((len(centroids),), token))
        occurrence_row[members] = assigned + next_row
        next_row += len(centroids)
    return torch.cat(rows), torch.cat(row_token).long(), occurrence_row


def build_ce_table(encoder: torch.nn.Module, targets: Targets, corpus: Corpus, tokenizer, context_length: int,
                   clusters_per_token: int, kmeans_iters: int, seed: int, batch_size: int,
                   progress: bool = False) -> CETable:
    """CE from `encoder` over all targets (in memory; `save_ce_table` stores it)."""
    vectors, tokens = contextual_occurrences(encoder, targets, corpus, tokenizer, context_length, batch_size, progress)
    table, row_token, occurrence_row = reduce_rows(vectors, tokens, clusters_per_token, kmeans_iters, seed,
                                                   tokenizer.pad_token_id)
    lengths = [len(t) + 1 for t in targets.tokens]
    paths = [p.tolist() for p in torch.split(occurrence_row, lengths)]
    return CETable(table, row_token, paths)


def save_ce_table(table: CETable, directory: Path, model_fingerprint: str, targets_fingerprint: str) -> CETable:
    """Side files first, then the rows as a buffer whose manifest (written last) records the side files' sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    offsets = np.cumsum([0] + [len(p) for p in table.paths]).astype(np.int64)
    arrays = {"row_token.npy": table.row_token.numpy().astype(np.int64),
              "path_rows.npy": np.asarray([r for p in table.paths for r in p], dtype=np.int64),
              "path_offsets.npy": offsets}
    files = {name: write_shard(directory / name, array) for name, array in arrays.items()}
    Buffer.write(directory, table.vectors, dtype="float32", model_fingerprint=model_fingerprint,
                 corpus_fingerprint=targets_fingerprint, extra={"ce_files": files})
    return CETable(table.vectors, table.row_token, table.paths, directory)


def load_ce_table(directory: Path, model_fingerprint: Optional[str] = None,
                  targets_fingerprint: Optional[str] = None) -> CETable:
    """Open a stored CE (all sha256 checked); BufferError naming the file when it does not match."""
    buffer = Buffer.open(directory, model_fingerprint, targets_fingerprint, verify=True)
    manifest = directory / MANIFEST
    files = buffer.manifest.get("ce_files")
    if not isinstance(files, dict) or set(files) != set(SIDE_FILES):
        raise BufferError(f"{manifest}: field 'ce_files': missing or incomplete; {directory} is not a CE table")
    for name, sha in files.items():
        if not (directory / name).is_file() or sha256_file(directory / name) != sha:
            raise BufferError(f"{manifest}: field 'ce_files.{name}': {directory / name} is missing or does not "
                              "match its sha256; rebuild the CE table")
    row_token = torch.from_numpy(np.load(directory / "row_token.npy"))
    flat, offsets = np.load(directory / "path_rows.npy"), np.load(directory / "path_offsets.npy")
    paths = [flat[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
    vectors = buffer.tensor().float()
    if len(row_token) != len(vectors):
        raise BufferError(f"{manifest}: {len(vectors)} rows but row_token.npy has {len(row_token)} entries")
    return CETable(vectors, row_token, paths, directory)


def ce_folder(root: Path, model_fingerprint: str, targets_fingerprint: str) -> Path:
    return Path(root) / f"ce-{model_fingerprint[:12]}-{targets_fingerprint[:12]}"

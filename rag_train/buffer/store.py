"""The stale embedding buffer on disk: `manifest.json` + row-range shards of `.npy` (memmap-readable).

A buffer is reused across runs and tasks, so the manifest records what produced it (model and corpus
fingerprints) and every shard's sha256; opening checks them and refuses a buffer that does not match
instead of silently training against the wrong vectors. bfloat16 has no numpy dtype and is stored as
uint16 bit patterns (`tensor()` views them back as torch.bfloat16).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from rag_train.io import atomic_open, atomic_write_json, sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STORAGE_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class BufferError(ValueError):
    """A buffer directory that cannot be used as asked; the message says which file / field and why."""


def shard_file_name(index: int) -> str:
    return f"shard-{index:05d}.npy"


def to_storage(vectors: Union[torch.Tensor, np.ndarray], dtype: str) -> np.ndarray:
    """Vectors [n, D] as the numpy array written to disk for `dtype`."""
    if dtype not in STORAGE_DTYPES:
        raise BufferError(f"dtype {dtype!r} is not one of {list(STORAGE_DTYPES)}")
    tensor = torch.as_tensor(vectors).detach().to("cpu", TORCH_DTYPES[dtype]).contiguous()
    if dtype == "bfloat16":
        tensor = tensor.view(torch.int16)
    return tensor.numpy().view(STORAGE_DTYPES[dtype])


def decode_rows(array: np.ndarray, dtype: str) -> np.ndarray:
    """Stored rows as float32. bfloat16 is stored as its bits (uint16): the high half of a float32, shifted back."""
    if dtype == "bfloat16":
        return (np.asarray(array, dtype=np.uint32) << 16).view(np.float32)
    return np.asarray(array, dtype=np.float32)


def write_shard(path: Path, array: np.ndarray, needed: Optional[int] = None) -> str:
    """Write one shard atomically; return its sha256. `needed`: the bytes a full disk is reported against (default
    the shard's own)."""
    with atomic_open(path, "wb", needed=needed or array.nbytes + 128) as handle:
        np.save(handle, array, allow_pickle=False)
    return sha256_file(path)


def vectors_fingerprint(model: Any) -> str:
    """sha256 of everything a buffer's vectors depend on, the `model_fingerprint` of its manifest: the model's
    weights (`model.fingerprint()`: names, shapes, dtypes, bytes) and, for a DualEncoder, how its passage tower
    turns text into a vector: its modules and their settings (pooling, projection, normalisation, lower-casing),
    maximum lengths and tokenizer. Two models that share weights but pool, normalise, truncate or tokenize
    differently get different fingerprints, so neither reuses the other's buffer."""
    settings: dict[str, Any] = {"weights": model.fingerprint()}
    tower = getattr(model, "passage_encoder", None)
    if tower is not None:
        settings["max_passage_length"] = model.max_passage_length
        settings["max_seq_length"] = tower.max_seq_length
        settings["modules"] = [[type(module).__name__, module.get_config_dict() if hasattr(module, "get_config_dict")
                                else {}] for module in tower]
        settings["tokenizer"] = _tokenizer_fingerprint(tower.tokenizer)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of a tokenizer's definition (vocabulary, normaliser, pre-tokenizer, post-processor); not of the
    truncation / padding state a fast tokenizer records from its last call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    return definition_fingerprint(backend.to_str())


@functools.lru_cache(maxsize=4)
def definition_fingerprint(backend_json: str) -> str:
    """sha256 of a Rust tokenizer's JSON (`Tokenizer.to_str()`) without its truncation / padding state. Remembered:
    every pass asks it of its tokenizer when a token cache is registered (a T5 tokenizer's JSON is megabytes)."""
    definition = {k: v for k, v in json.loads(backend_json).items() if k not in ("truncation", "padding")}
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()


def manifest_dict(rows: int, dim: int, dtype: str, shards: list[dict], model_fingerprint: Optional[str],
                  corpus_fingerprint: Optional[str], complete: bool, **extra: Any) -> dict:
    return {"format_version": FORMAT_VERSION, "rows": rows, "dim": dim, "dtype": dtype, "shards": shards,
            "model_fingerprint": model_fingerprint, "corpus_fingerprint": corpus_fingerprint,
            "complete": complete, **extra}


_TYPES = {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "an object",
          type(None): "null"}
FIELD_TYPES = {"format_version": (int,), "rows": (int,), "dim": (int,), "dtype": (str,), "shards": (list,),
               "model_fingerprint": (str, type(None)), "corpus_fingerprint": (str, type(None)), "complete": (bool,)}
SHARD_FIELD_TYPES = {"file": (str,), "start": (int,), "end": (int,), "sha256": (str,)}


def _check_type(path: Path, field: str, value: Any, types: tuple) -> None:
    """BufferError naming the manifest, the field and the expected type (a bool is not an integer here)."""
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
        return
    expected = " or ".join(_TYPES[t] for t in types)
    got = _TYPES.get(type(value), type(value).__name__)
    raise BufferError(f"{path}: field '{field}': expected {expected}, got {json.dumps(value)[:60]} ({got}); the "
                      "manifest is corrupt or was edited by hand")


def read_manifest(path: Path) -> dict:
    """A buffer manifest whose required fields are present and of their types: a field of the wrong type is named
    here, not later as an odd comparison or shape. BufferError naming the file otherwise."""
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        line = f":{exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise BufferError(f"{path}{line}: not valid JSON, the manifest is truncated or corrupt ({exc})") from None
    if not isinstance(manifest, dict):
        raise BufferError(f"{path}: expected a JSON object, got {_TYPES.get(type(manifest), type(manifest).__name__)}")
    for key, types in FIELD_TYPES.items():
        if key not in manifest:
            raise BufferError(f"{path}: field '{key}': missing")
        _check_type(path, key, manifest[key], types)
    for i, shard in enumerate(manifest["shards"]):
        _check_type(path, f"shards[{i}]", shard, (dict,))
        for key, types in SHARD_FIELD_TYPES.items():
            if key not in shard:
                raise BufferError(f"{path}: field 'shards[{i}].{key}': missing")
            _check_type(path, f"shards[{i}].{key}", shard[key], types)
    return manifest


class Buffer:
    """Read-only view of a complete buffer directory; rows are global corpus rows 0..N-1."""

    def __init__(self, directory: Path, manifest: dict, arrays: list[np.ndarray]):
        self.path = directory
        self.manifest = manifest
        self._arrays = arrays
        self._starts = [s["start"] for s in manifest["shards"]]

    @property
    def rows(self) -> int:
        return int(self.manifest["rows"])

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    def __len__(self) -> int:
        return self.rows

    @classmethod
    def open(cls, directory: Union[str, Path], model_fingerprint: Optional[str] = None,
             corpus_fingerprint: Optional[str] = None, verify: bool = False) -> "Buffer":
        """Open and validate; with fingerprints given, refuse a buffer made by another model / corpus."""
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise BufferError(f"{path}: not found; {directory} is not a buffer "
                              "(build one with scripts/embed_corpus.py)")
        manifest = read_manifest(path)
        if manifest["format_version"] != FORMAT_VERSION:
            raise BufferError(f"{path}: field 'format_version': {manifest['format_version']!r} is not {FORMAT_VERSION}")
        if manifest["dtype"] not in STORAGE_DTYPES:
            raise BufferError(f"{path}: field 'dtype': {manifest['dtype']!r} is not one of {list(STORAGE_DTYPES)}")
        if not manifest["complete"]:
            raise BufferError(f"{path}: field 'complete': false; the build was interrupted - rerun it to resume")
        for key, expected in (("model_fingerprint", model_fingerprint), ("corpus_fingerprint", corpus_fingerprint)):
            if expected is not None and manifest[key] != expected:
                what = "retriever model" if key == "model_fingerprint" else "corpus"
                raise BufferError(
                    f"{path}: field '{key}': buffer was built from a different {what} (the buffer's {manifest[key]}, "
                    f"expected {expected}); rebuild it or point buffer.path elsewhere")
        arrays = cls._load_shards(directory, manifest, verify)
        return cls(directory, manifest, arrays)

    @staticmethod
    def _load_shards(directory: Path, manifest: dict, verify: bool) -> list[np.ndarray]:
        path = directory / MANIFEST
        storage = np.dtype(STORAGE_DTYPES[manifest["dtype"]])
        arrays, expected_start = [], 0
        for i, shard in enumerate(manifest["shards"]):
            where = f"{path}: field 'shards[{i}]'"
            if shard.get("start") != expected_start or shard.get("end", -1) <= shard["start"]:
                raise BufferError(f"{where}: rows {shard.get('start')}..{shard.get('end')} "
                                  f"do not continue at {expected_start}")
            file = directory / shard["file"]
            if not file.is_file():
                raise BufferError(f"{where}: shard file {file} is missing")
            if verify and sha256_file(file) != shard["sha256"]:
                raise BufferError(f"{where}: sha256 of {file} does not match the manifest (file corrupted or replaced)")
            try:
                array = np.load(file, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:  # a truncated file: header or data shorter than stated
                raise BufferError(f"{where}: {file} cannot be read, it is truncated or corrupt ({exc}); "
                                  "rebuild the buffer") from None
            want = (shard["end"] - shard["start"], manifest["dim"])
            if array.shape != want or array.dtype != storage:
                raise BufferError(f"{where}: {file} holds {array.shape} {array.dtype}, expected {want} {storage}")
            arrays.append(array)
            expected_start = shard["end"]
        if expected_start != manifest["rows"]:
            raise BufferError(f"{path}: field 'rows': shards cover {expected_start} rows, "
                              f"manifest says {manifest['rows']}")
        return arrays

    @classmethod
    def write(cls, directory: Union[str, Path], embeddings: Union[torch.Tensor, np.ndarray], dtype: str = "float16",
              model_fingerprint: Optional[str] = None, corpus_fingerprint: Optional[str] = None,
              shard_rows: Optional[int] = None, extra: Optional[dict] = None) -> "Buffer":
        """Write an in-memory [N, D] matrix as a buffer (small cases; large corpora use build_buffer). `extra`:
        further manifest fields (e.g. the sha256 of side files that belong with the rows)."""
        directory = Path(directory)
        array = to_storage(embeddings, dtype)
        if array.ndim != 2 or array.shape[0] == 0:
            raise BufferError(f"embeddings must be a non-empty [N, D] matrix, got shape {tuple(array.shape)}")
        rows = array.shape[0]
        step = shard_rows or rows
        shards = []
        for index, start in enumerate(range(0, rows, step)):
            end = min(start + step, rows)
            name = shard_file_name(index)
            sha = write_shard(directory / name, array[start:end])
            shards.append({"file": name, "start": start, "end": end, "sha256": sha})
        atomic_write_json(directory / MANIFEST, manifest_dict(rows, array.shape[1], dtype, shards, model_fingerprint,
                                                             corpus_fingerprint, complete=True, **(extra or {})))
        return cls.open(directory)

    def verify(self, rank: int = 0, world: int = 1) -> None:
        """Check the sha256 of shards rank, rank + world, ... against the manifest (a process's share of the
        work); BufferError naming the first shard file that does not match."""
        path = self.path / MANIFEST
        for i, shard in list(enumerate(self.manifest["shards"]))[rank::world]:
            file = self.path / shard["file"]
            if sha256_file(file) != shard["sha256"]:
                raise BufferError(f"{path}: field 'shards[{i}]': sha256 of {file} does not match the manifest "
                                  "(file corrupted or replaced); rebuild the buffer")

    def views(self, start: int = 0, end: Optional[int] = None) -> list[tuple[int, np.ndarray]]:
        """Zero-copy memmap pieces `(global_start, array)` covering rows [start, end)."""
        end = self.rows if end is None else end
        if not 0 <= start <= end <= self.rows:
            raise IndexError(f"rows [{start}, {end}) outside buffer of {self.rows} rows")
        pieces = []
        for shard_start, array in zip(self._starts, self._arrays):
            lo, hi = max(start, shard_start), min(end, shard_start + len(array))
            if lo < hi:
                pieces.append((lo, array[lo - shard_start:hi - shard_start]))
        return pieces

    def moments(self, chunk_rows: int = 1 << 16) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-dimension mean and (population) standard deviation of every row, float64, in one streaming pass over
        the memmaps (every process computes the same from the same files)."""
        total, squares = np.zeros(self.dim), np.zeros(self.dim)
        for _, array in self.views():
            for lo in range(0, len(array), chunk_rows):
                block = decode_rows(array[lo:lo + chunk_rows], self.dtype).astype(np.float64)
                total += block.sum(axis=0)
                squares += np.square(block).sum(axis=0)
        mean = total / max(self.rows, 1)
        variance = np.maximum(squares / max(self.rows, 1) - np.square(mean), 0.0)
        return torch.from_numpy(mean), torch.from_numpy(np.sqrt(variance))

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """float32 [len(rows), dim] for global rows in any order (repeats too), read shard by shard in ascending
        order from the memmaps: only the rows asked for are copied (`array()` of a buffer of several shards copies
        all of it: 43 GB at 28M x 768 bf16), and bfloat16 bits are decoded."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) and not (0 <= rows.min() and rows.max() < self.rows):
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside buffer of {self.rows} rows")
        order = np.argsort(rows, kind="stable")
        ascending = rows[order]
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        for shard_start, array in zip(self._starts, self._arrays):
            lo, hi = np.searchsorted(ascending, [shard_start, shard_start + len(array)])
            if lo < hi:
                out[order[lo:hi]] = decode_rows(array[ascending[lo:hi] - shard_start], self.dtype)
        return out

    def shard(self, start: int, end: int) -> np.ndarray:
        """Rows [start, end) in storage dtype: a memmap view inside one shard file, else a copy."""
        pieces = [array for _, array in self.views(start, end)]
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return np.empty((0, self.dim), STORAGE_DTYPES[self.dtype])
        return np.concatenate(pieces)

    def array(self) -> np.ndarray:
        """All rows in storage dtype: a memmap when the buffer has one shard, else a copy of every shard (for some
        rows, `gather`)."""
        return self.shard(0, self.rows)

    def tensor(self, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Rows [start, end) loaded into memory as a CPU tensor in the buffer's dtype (bfloat16 from its bits)."""
        array = np.ascontiguousarray(self.shard(start, self.rows if end is None else end))
        tensor = torch.from_numpy(np.array(array, copy=True) if not array.flags.writeable else array)
        return tensor.view(torch.bfloat16) if self.dtype == "bfloat16" else tensor

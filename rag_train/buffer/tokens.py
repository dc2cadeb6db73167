"""The corpus's token ids, computed once: every later corpus pass reads them instead of tokenising again (on an H100
the tiny tower's pass spent 59% of its time tokenising, docs/generated/gpu_report.md).

A token cache is a folder beside the buffer (`<buffer>.tokens`), laid out like the buffer (store.py, build.py):
`manifest.json` (rows, id dtype, the fingerprints of the corpus and of the tokenizer's definition, `max_length`,
`truncation_side`, shards with row ranges and sha256) and per shard of rows a flat array of every row's ids
(`ids-NNNNN.npy`, uint16 when the vocabulary fits, else int32) and the rows' offsets into it (`offsets-NNNNN.npy`,
int64, one more than the rows, from 0): both memory-mapped, so a row's ids are read without parsing anything. Ids
are exactly what `PassageTokenizer.encode` gives (special tokens added, truncated at `max_length`). A finished
shard is written atomically with its record (`ids-NNNNN.json`), so a killed build resumes from the written shards,
and a stop signal ends a build at a shard boundary (as it does a buffer's); a cache of another corpus, tokenizer or
max length is refused, naming the file and field, and never overwritten without `overwrite`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from rag_train.buffer.build import plan_shards, shards_of_process
from rag_train.buffer.embed import CHUNK_BATCHES, CorpusPasses, PassageTokenizer, _quiet_worker
from rag_train.buffer.store import MANIFEST, BufferError, _check_type, write_shard
from rag_train.data.corpus import Corpus
from rag_train.io import atomic_write_json, remove_stale_temporaries, sha256_file, write_step
from rag_train.preemption import StopSignal, agreed_rounds

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
KIND = "token_ids"
ROWS_PER_ITEM = 256 * CHUNK_BATCHES  # rows a worker tokenises at once
# what a cache is of: a field that differs from the wanted value makes it another corpus's / tokenizer's cache
IDENTITY = ("corpus_fingerprint", "tokenizer_fingerprint", "max_length", "truncation_side")
FIELD_TYPES = {"format_version": (int,), "kind": (str,), "rows": (int,), "dtype": (str,), "shards": (list,),
               "complete": (bool,), "shard_rows": (int,), "corpus_fingerprint": (str,),
               "tokenizer_fingerprint": (str,), "max_length": (int,), "truncation_side": (str,)}


class TokenCacheError(BufferError):
    """A token cache that cannot be used as asked; the message names the file and field."""


def token_cache_dir(buffer_dir: Union[str, Path]) -> Path:
    """Where the token cache beside a buffer folder lives (a training run's, or scripts/embed_corpus.py's output):
    `<buffer>.tokens`, a sibling, so the buffer folder holds only the buffer's own files."""
    buffer_dir = Path(buffer_dir)
    return buffer_dir.with_name(buffer_dir.name + ".tokens")


def id_dtype(tokenizer: PassageTokenizer) -> str:
    return "uint16" if tokenizer.backend.get_vocab_size(with_added_tokens=True) <= 1 << 16 else "int32"


def identity(corpus: Corpus, tokenizer: PassageTokenizer) -> dict:
    """The manifest fields that say what a cache was made from."""
    return {"corpus_fingerprint": corpus.fingerprint, "tokenizer_fingerprint": tokenizer.fingerprint,
            "max_length": tokenizer.max_length, "truncation_side": tokenizer.truncation_side}


def _mismatch(path: Path, found: dict, wanted: dict) -> Optional[str]:
    """The message naming the first identity field of `found` that differs from `wanted`, and all that do."""
    differing = [key for key in IDENTITY if found.get(key) != wanted[key]]
    if not differing:
        return None
    shown = "; ".join(f"{key}: the cache's {found.get(key)!r}, wanted {wanted[key]!r}" for key in differing)
    return (f"{path}: field '{differing[0]}': this token cache was made from another "
            f"{', '.join(k.replace('_fingerprint', '') for k in differing)} ({shown})")


def read_manifest(path: Path) -> dict:
    """A token cache manifest whose fields are present and of their types; TokenCacheError naming the file else."""
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenCacheError(f"{path}: not valid JSON, the manifest is truncated or corrupt ({exc})") from None
    if not isinstance(manifest, dict):
        raise TokenCacheError(f"{path}: expected a JSON object")
    for key, types in FIELD_TYPES.items():
        if key not in manifest:
            raise TokenCacheError(f"{path}: field '{key}': missing")
        try:
            _check_type(path, key, manifest[key], types)
        except BufferError as exc:
            raise TokenCacheError(str(exc)) from None
    if manifest["kind"] != KIND or manifest["format_version"] != FORMAT_VERSION:
        raise TokenCacheError(f"{path}: field 'kind' / 'format_version': {manifest['kind']!r} version "
                              f"{manifest['format_version']} is not a token cache of version {FORMAT_VERSION}")
    return manifest


class TokenCache:
    """Read-only view of a complete token cache: the ids of global corpus rows 0..N-1."""

    def __init__(self, directory: Path, manifest: dict, ids: list[np.ndarray], offsets: list[np.ndarray]):
        self.path = directory
        self.manifest = manifest
        self._ids = ids
        self._offsets = offsets
        self._starts = np.array([shard["start"] for shard in manifest["shards"]], dtype=np.int64)

    @property
    def rows(self) -> int:
        return int(self.manifest["rows"])

    @property
    def corpus_fingerprint(self) -> str:
        return self.manifest["corpus_fingerprint"]

    def __len__(self) -> int:
        return self.rows

    @classmethod
    def open(cls, directory: Union[str, Path], corpus: Optional[Corpus] = None,
             tokenizer: Optional[PassageTokenizer] = None, verify: bool = False) -> "TokenCache":
        """Open and validate; given the corpus and tokenizer, refuse a cache made from another corpus, tokenizer,
        max length or truncation side."""
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise TokenCacheError(f"{path}: not found; {directory} is not a token cache")
        manifest = read_manifest(path)
        if not manifest["complete"]:
            raise TokenCacheError(f"{path}: field 'complete': false; the build was interrupted - rerun it to resume")
        if corpus is not None and tokenizer is not None:
            message = _mismatch(path, manifest, identity(corpus, tokenizer))
            if message:
                raise TokenCacheError(message)
        ids, offsets, expected_start = [], [], 0
        for i, shard in enumerate(manifest["shards"]):
            where = f"{path}: field 'shards[{i}]'"
            if shard.get("start") != expected_start or shard.get("end", -1) <= expected_start:
                raise TokenCacheError(f"{where}: rows {shard.get('start')}..{shard.get('end')} do not continue at "
                                      f"{expected_start}")
            arrays = []
            for key, dtype in (("ids", manifest["dtype"]), ("offsets", "int64")):
                file = directory / shard[key]
                if not file.is_file():
                    raise TokenCacheError(f"{where}: file {file} is missing")
                if verify and sha256_file(file) != shard[f"{key}_sha256"]:
                    raise TokenCacheError(f"{where}: sha256 of {file} does not match the manifest")
                try:
                    arrays.append(np.load(file, mmap_mode="r", allow_pickle=False))
                except (ValueError, OSError, EOFError) as exc:
                    raise TokenCacheError(f"{where}: {file} cannot be read, it is truncated or corrupt "
                                          f"({exc})") from None
                if arrays[-1].dtype != np.dtype(dtype) or arrays[-1].ndim != 1:
                    raise TokenCacheError(f"{where}: {file} holds {arrays[-1].dtype}, expected a flat {dtype} array")
            if len(arrays[1]) != shard["end"] - shard["start"] + 1 or int(arrays[1][-1]) != len(arrays[0]):
                raise TokenCacheError(f"{where}: {directory / shard['offsets']} does not index "
                                      f"{directory / shard['ids']} for rows {shard['start']}..{shard['end']}")
            ids.append(arrays[0])
            offsets.append(arrays[1])
            expected_start = shard["end"]
        if expected_start != manifest["rows"]:
            raise TokenCacheError(f"{path}: field 'rows': shards cover {expected_start} rows, manifest says "
                                  f"{manifest['rows']}")
        return cls(directory, manifest, ids, offsets)

    def differences(self, tokenizer: PassageTokenizer) -> list[str]:
        """The identity fields in which `tokenizer` is not the one this cache was made by."""
        wanted = {"tokenizer_fingerprint": tokenizer.fingerprint, "max_length": tokenizer.max_length,
                  "truncation_side": tokenizer.truncation_side}
        return [key for key, value in wanted.items() if self.manifest[key] != value]

    def check(self, corpus: Corpus, tokenizer: PassageTokenizer) -> None:
        """TokenCacheError naming the field unless this cache was made from `corpus` by `tokenizer`."""
        message = _mismatch(self.path / MANIFEST, self.manifest, identity(corpus, tokenizer))
        if message:
            raise TokenCacheError(message + "; embed without it, or build one for this corpus and tokenizer")

    def _spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard index, first id position, length) of each global row."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) and not (0 <= rows.min() and rows.max() < self.rows):
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside the token cache of {self.rows} rows")
        shard = np.searchsorted(self._starts, rows, side="right") - 1
        begin, length = np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
        for index in np.unique(shard):
            mine = shard == index
            local = rows[mine] - self._starts[index]
            offsets = self._offsets[index]
            begin[mine] = offsets[local]
            length[mine] = offsets[local + 1] - begin[mine]
        return shard, begin, length

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        """int64 token count of each row."""
        return self._spans(rows)[2]

    def ids(self, row: int) -> np.ndarray:
        """One row's ids (int64)."""
        shard, begin, length = self._spans(np.array([row]))
        return np.asarray(self._ids[shard[0]][begin[0]: begin[0] + length[0]], dtype=np.int64)

    def padded(self, rows: np.ndarray, pad_id: int) -> np.ndarray:
        """int64 [len(rows), longest] ids of `rows`, right-padded with `pad_id`: one vectorised gather per shard."""
        shard, begin, length = self._spans(rows)
        width = int(length.max()) if len(length) else 0
        columns = np.arange(width)
        out = np.full((len(length), width), pad_id, dtype=np.int64)
        for index in np.unique(shard):
            mine = np.flatnonzero(shard == index)
            real = columns < length[mine, None]
            positions = begin[mine, None] + columns
            ids = self._ids[index]
            gathered = ids[np.where(real, positions, 0)].astype(np.int64) if len(ids) else pad_id
            out[mine] = np.where(real, gathered, pad_id)
        return out


def finished_token_cache(directory: Union[str, Path]) -> Optional[TokenCache]:
    """The complete token cache at `directory`, or None when there is none or its build did not finish: for a reader
    that can tokenise instead (a cache of another corpus or tokenizer is then simply not matched by a pass)."""
    manifest = Path(directory) / MANIFEST
    if not manifest.is_file() or not read_manifest(manifest)["complete"]:
        return None
    return TokenCache.open(directory)


@dataclass
class _Pieces(Dataset):
    """Item i: (flat ids, lengths) of corpus rows [start, end) of piece i, tokenised in row order."""

    corpus: Corpus
    tokenizer: PassageTokenizer
    pieces: list[tuple[int, int]]
    dtype: str

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        from rag_train.models.retriever import format_passage

        start, end = self.pieces[index]
        ids, lengths = self.tokenizer.encode([format_passage(p) for p in self.corpus.passages(range(start, end))])
        flat = np.fromiter((i for row in ids for i in row), dtype=self.dtype, count=int(lengths.sum()))
        return flat, lengths


def _as_is(item):
    return item


def tokenize_rows(corpus: Corpus, tokenizer: PassageTokenizer, start: int, end: int, dtype: str,
                  num_workers: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(flat ids, int64 offsets from 0) of corpus rows [start, end), tokenised in `num_workers` DataLoader workers
    (0: in this process); the same bytes whatever `num_workers` is. Fewer than two workers' worth of pieces are
    tokenised here: this process only waits for its workers, so one worker adds a fork and nothing else (and a fork
    of a process whose gloo threads were running hung a two-process test once in 139 launches, docs/test_suite.md)."""
    pieces = [(s, min(s + ROWS_PER_ITEM, end)) for s in range(start, end, ROWS_PER_ITEM)]
    workers = min(num_workers, len(pieces))
    if workers < 2:
        workers = 0
    # numpy items as they are (the default would make tensors of them); its own generator, as in embed.py
    loader = DataLoader(_Pieces(corpus, tokenizer, pieces, dtype), batch_size=None, shuffle=False,
                        num_workers=workers, collate_fn=_as_is, worker_init_fn=_quiet_worker if workers else None,
                        generator=torch.Generator())
    flats, lengths = [], []
    for flat, length in loader:
        flats.append(flat)
        lengths.append(length)
    offsets = np.zeros(end - start + 1, dtype=np.int64)
    np.cumsum(np.concatenate(lengths), out=offsets[1:])
    return np.concatenate(flats).astype(dtype, copy=False), offsets


def _files(index: int) -> dict:
    return {"ids": f"ids-{index:05d}.npy", "offsets": f"offsets-{index:05d}.npy"}


def _sidecar(out_dir: Path, index: int) -> Path:
    return out_dir / f"ids-{index:05d}.json"  # not shard-*.json: a buffer's records are named so


def _finished(out_dir: Path, index: int, expected: dict) -> Optional[dict]:
    """The record of shard `index` if it and both its files are on disk and match the planned shard, else None."""
    sidecar = _sidecar(out_dir, index)
    if not sidecar.is_file() or not all((out_dir / expected[key]).is_file() for key in ("ids", "offsets")):
        return None
    try:
        record = json.loads(sidecar.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or any(record.get(key) != value for key, value in expected.items()):
        return None
    intact = all(sha256_file(out_dir / expected[key]) == record.get(f"{key}_sha256") for key in ("ids", "offsets"))
    return record if intact else None


def _existing(out_dir: Path, wanted: dict, overwrite: bool) -> Optional[dict]:
    """The manifest already in `out_dir` if it is of this corpus and tokenizer, else None (none there, or one of
    another that `overwrite` replaces); without `overwrite`, TokenCacheError naming the file and field for a manifest
    of another corpus / tokenizer or one that cannot be read."""
    path = out_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = read_manifest(path)
    except TokenCacheError as exc:
        if overwrite:
            return None
        raise TokenCacheError(f"{exc}; it is not overwritten - rerun with overwrite, or choose another "
                              "folder") from None
    message = _mismatch(path, manifest, wanted)
    if message and overwrite:
        return None
    if message:
        raise TokenCacheError(f"{message}; it is not overwritten - rerun with overwrite (a run-owned cache is), "
                              "choose another folder or delete it")
    return manifest


def build_token_cache(corpus: Corpus, tokenizer: PassageTokenizer, out_dir: Union[str, Path],
                      shard_rows: int = 1_000_000, num_workers: int = 0, accelerator=None, overwrite: bool = False,
                      passes: Optional[CorpusPasses] = None, stop: Optional[StopSignal] = None) -> TokenCache:
    """Tokenise every corpus row once into a token cache at `out_dir`, or reuse the complete one there; a killed build
    resumes from its written shards. With an accelerate `Accelerator` each process tokenises its own block of
    shards; every process returns the same opened cache. A cache (complete or not) of another corpus, tokenizer, max
    length or truncation side there is an error unless `overwrite`. `passes` records the tokenisation as a corpus
    pass (nothing when the cache is reused). `stop`: as in `build_buffer`, before each shard every process asks
    whether any of them got a stop signal; if so all stop there (Preempted), the shards they finished kept, and the
    same call resumes (a shard of a million rows takes minutes)."""
    if shard_rows <= 0:
        raise ValueError(f"shard_rows={shard_rows} must be > 0")
    out_dir = Path(out_dir)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    wanted = identity(corpus, tokenizer)
    existing = _existing(out_dir, wanted, overwrite)
    complete = existing is not None and existing["complete"]
    if not complete and rank == 0:
        remove_stale_temporaries(out_dir)  # a killed build's temporary files: no process writes yet
    if accelerator is not None:  # nobody writes before every process has looked
        accelerator.wait_for_everyone()
    if complete:
        logger.info("%s already holds this corpus's token ids; nothing to tokenise", out_dir)
        return TokenCache.open(out_dir, corpus, tokenizer)
    rows, dtype = len(corpus), id_dtype(tokenizer)
    plan = plan_shards(rows, shard_rows)
    planned = [{**_files(i), "start": s, "end": e, "dtype": dtype, **wanted} for i, (s, e) in enumerate(plan)]
    with write_step("creating the token cache folder", out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        atomic_write_json(out_dir / MANIFEST, _manifest(rows, dtype, shard_rows, [], wanted, complete=False))
    todo = [i for i in shards_of_process(len(plan), rank, world) if _finished(out_dir, i, planned[i]) is None]
    share = f" (rank 0's share of {world} processes)" if world > 1 else ""
    total = sum(plan[i][1] - plan[i][0] for i in todo)
    timed = passes.timed(f"token cache build{share}", total) if passes and todo else contextlib.nullcontext()

    def stopped(undone: int) -> str:
        return (f"{len(plan) - undone} of {len(plan)} token-cache shards of {out_dir} are written, each with its "
                f"record, and kept; run the same command again to tokenise the other {undone} and finish the token "
                "cache")

    with timed:
        for position in agreed_rounds(len(todo), stop, accelerator, stopped):
            index = todo[position]
            start, end = plan[index]
            flat, offsets = tokenize_rows(corpus, tokenizer, start, end, dtype, num_workers)
            record = dict(planned[index])
            for key, array in (("ids", flat), ("offsets", offsets)):
                record[f"{key}_sha256"] = write_shard(out_dir / record[key], array)
            atomic_write_json(_sidecar(out_dir, index), record)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    if rank == 0:
        shards = []
        for index, expected in enumerate(planned):
            record = _finished(out_dir, index, expected)
            if record is None:
                raise TokenCacheError(f"{_sidecar(out_dir, index)}: shard {index} missing or corrupt after the build")
            shards.append({key: record[key] for key in ("ids", "offsets", "start", "end", "ids_sha256",
                                                        "offsets_sha256")})
        atomic_write_json(out_dir / MANIFEST, _manifest(rows, dtype, shard_rows, shards, wanted, complete=True))
        for path in out_dir.glob("*-*.*"):  # shards of an overwritten, larger cache
            stem, _, number = path.stem.partition("-")
            if stem in ("ids", "offsets") and number.isdigit() and int(number) >= len(plan):
                path.unlink()
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return TokenCache.open(out_dir, corpus, tokenizer)


def _manifest(rows: int, dtype: str, shard_rows: int, shards: list[dict], wanted: dict, complete: bool) -> dict:
    return {"format_version": FORMAT_VERSION, "kind": KIND, "rows": rows, "dtype": dtype, "shard_rows": shard_rows,
            "shards": shards, "complete": complete, **wanted}

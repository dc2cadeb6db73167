"""Random access to a passage collection of tens of millions of rows with flat memory.

The source (JSONL `{id|_id, title, text}`; TSV: DPR `id<TAB>text<TAB>title` with a header, MS MARCO
`id<TAB>text` without one; or a parquet file / `datasets.save_to_disk` folder, see `arrow_corpus`) is
scanned once; the scan validates every row and writes an index directory of numpy arrays that are
memory-mapped afterwards. Ids are stripped of surrounding whitespace when read (`"p1 "` is `"p1"`, so two ids
that differ only there are the duplicate-id error), and passages with blank text are counted and warned about
(`BlankPassagesWarning`) every time the corpus is opened:

    offsets.npy     int64[N+1]  byte offset of each passage's line (last entry: file size); for Arrow
                                sources the running total of title + text bytes (a length proxy)
    ids.npy         S{w}[N]     passage id by row (fixed-width bytes)
    sorted_ids.npy  S{w}[N]     the same ids sorted, for binary search (id -> row)
    order.npy       int64[N]    row of each sorted id
    meta.json       format, row count, source size / mtime, sha256 fingerprint (written last)

Text is never held in memory: `text(row)` reads one line at its offset and parses it (Arrow sources:
one value of the memory-mapped columns).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import warnings
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
from tqdm.auto import tqdm

from rag_train.data.arrow_corpus import ArrowRows, is_arrow_source, scan_arrow, source_stat
from rag_train.data.errors import DataError, data_error, row_ref
from rag_train.io import atomic_open, atomic_write_json

INDEX_VERSION = 2  # 2: ids stripped of surrounding whitespace, blank passages counted
_ID_KEYS = ("id", "_id")
_HEADER_ID = ("id", "_id", "pid", "docid", "doc_id")
_HEADER_TEXT = ("text", "passage", "contents")
_HEADER_TITLE = ("title",)
_PROGRESS_MIN_BYTES = 64 << 20
_ARRAYS = ("offsets", "ids", "sorted_ids", "order")


@dataclass(frozen=True)
class _Layout:
    """How one line of the file maps to (id, title, text)."""

    kind: str  # "jsonl" | "tsv" | "arrow"
    columns: int = 0  # tsv: expected number of columns
    id_col: int = 0
    text_col: int = 1
    title_col: Optional[int] = None
    quoted: bool = False  # tsv with a header follows DPR's csv quoting ("" escapes)
    arrow: Optional[dict] = None  # arrow: column names and converted files (see arrow_corpus.scan_arrow)


def _detect_layout(path: Path, first_line: str, line: int) -> tuple[_Layout, bool]:
    """Decide the format from the extension (or the first line) and whether that line is a header."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json") or (suffix != ".tsv" and first_line.lstrip().startswith("{")):
        return _Layout("jsonl"), False
    if suffix != ".tsv" and "\t" not in first_line:
        raise data_error(path, line, None,
                         "expected passages as JSONL ({id,title,text}) or TSV (id<TAB>text[<TAB>title])")
    names = [name.strip().lower() for name in first_line.rstrip("\r\n").split("\t")]
    id_col = next((i for i, n in enumerate(names) if n in _HEADER_ID), None)
    text_col = next((i for i, n in enumerate(names) if n in _HEADER_TEXT), None)
    if id_col is not None and text_col is not None:
        title_col = next((i for i, n in enumerate(names) if n in _HEADER_TITLE), None)
        return _Layout("tsv", len(names), id_col, text_col, title_col, quoted=True), True
    if id_col is not None or text_col is not None:
        raise data_error(path, line, None,
                         f"header {names} needs an id column {_HEADER_ID} and a text column {_HEADER_TEXT}")
    if len(names) not in (2, 3):
        raise data_error(path, line, None,
                         f"headerless TSV needs 2 (id, text) or 3 (id, text, title) columns, got {len(names)}")
    return _Layout("tsv", len(names), 0, 1, 2 if len(names) == 3 else None), False


def _parse(layout: _Layout, line_text: str, path: Path, line: Optional[int]) -> tuple[str, str, str]:
    """(id, title, text) of one line; DataError naming the line and field when it is malformed."""
    if layout.kind == "jsonl":
        try:
            record = json.loads(line_text)
        except json.JSONDecodeError as exc:
            raise data_error(path, line, None, f"bad JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise data_error(path, line, None, f"expected a JSON object, got {type(record).__name__}")
        id_key = next((k for k in _ID_KEYS if k in record), "id")
        pid, title, text = record.get(id_key), record.get("title"), record.get("text")
        if isinstance(pid, int) and not isinstance(pid, bool):
            pid = str(pid)
        if not isinstance(pid, str):
            raise data_error(path, line, id_key, "missing or not a string / integer")
        if not isinstance(text, str):
            raise data_error(path, line, "text", "missing or not a string")
        if title is not None and not isinstance(title, str):
            raise data_error(path, line, "title", "not a string")
        title = title or ""
    else:
        stripped = line_text.rstrip("\r\n")
        if layout.quoted:
            try:
                fields = next(csv.reader([stripped], delimiter="\t", strict=True))
            except csv.Error as exc:
                raise data_error(path, line, None, f"bad TSV quoting ({exc})") from None
        else:
            fields = stripped.split("\t")
        if len(fields) != layout.columns:
            field = "text" if len(fields) <= layout.text_col else None
            raise data_error(path, line, field, f"expected {layout.columns} tab-separated columns, got {len(fields)}")
        pid, text = fields[layout.id_col], fields[layout.text_col]
        title = fields[layout.title_col] if layout.title_col is not None else ""
    pid = pid.strip()  # "p1 " and "p1" are one id: a trailing tab or space is an artefact of the export
    if not pid:
        raise data_error(path, line, "id", "empty passage id")
    if "\n" in pid or "\x00" in pid:
        raise data_error(path, line, "id", "passage id contains a newline or NUL byte")
    return pid, title, text


def _line_number(path: Path, offset: int) -> int:
    """1-based line number of the byte at `offset` (error path only: rescans the file)."""
    count, done = 1, 0
    with open(path, "rb") as handle:
        while done < offset:
            chunk = handle.read(min(1 << 22, offset - done))
            count, done = count + chunk.count(b"\n"), done + len(chunk)
    return count


def _fixed_width(blob: bytearray, lengths: array) -> np.ndarray:
    """Pack variable-length ids (concatenated in `blob`) into an S{w} array, column by column."""
    sizes = np.frombuffer(lengths, dtype=np.uint32).astype(np.int64)
    width = int(sizes.max())
    starts = np.cumsum(sizes) - sizes
    raw = np.frombuffer(blob, dtype=np.uint8)
    table = np.zeros((len(sizes), width), dtype=np.uint8)
    for col in range(width):
        rows = np.flatnonzero(sizes > col)
        table[rows, col] = raw[starts[rows] + col]
    return table.view(f"S{width}").reshape(len(sizes))


class BlankPassagesWarning(UserWarning):
    """A corpus holds passages whose text is empty or only whitespace: they are kept (rows stay aligned with the
    source) but can only be retrieved by their title."""


def _scan_lines(path: Path, stat) -> tuple[np.ndarray, bytearray, array, str, _Layout, dict]:
    """Scan a JSONL / TSV file once: validate every line, hash the content; (offsets, ids, hash, layout, blank
    passages: their count and the first one's id)."""
    if path.suffix.lower() in (".gz", ".bz2", ".xz", ".zst"):
        raise data_error(path, None, None, "compressed files cannot be read by offset; decompress first")
    digest = hashlib.sha256()
    offsets, id_lengths, id_blob = array("q"), array("I"), bytearray()
    layout, position, blank = None, 0, {"count": 0, "first_id": None}
    quiet = stat.st_size < _PROGRESS_MIN_BYTES or os.environ.get("RANK", "0") != "0"
    with open(path, "rb") as handle, tqdm(total=stat.st_size, unit="B", unit_scale=True,
                                          desc=f"indexing {path.name}", disable=quiet) as bar:
        for line_no, raw in enumerate(handle, start=1):
            digest.update(raw)
            start, position = position, position + len(raw)
            bar.update(len(raw))
            if not raw.rstrip(b"\r\n"):
                continue
            try:
                line_text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise data_error(path, line_no, None, f"not valid UTF-8 (byte {exc.start} of the line)") from None
            if layout is None:
                layout, is_header = _detect_layout(path, line_text, line_no)
                if is_header:
                    continue
            pid, _, text = _parse(layout, line_text, path, line_no)
            if not text.strip():
                blank["count"] += 1
                blank["first_id"] = blank["first_id"] or pid
            key = pid.encode("utf-8")
            offsets.append(start)
            id_lengths.append(len(key))
            id_blob += key
    if not offsets:
        raise data_error(path, None, None, "no passages (the file is empty)")
    offsets.append(position)
    return np.frombuffer(offsets, dtype=np.int64), id_blob, id_lengths, digest.hexdigest(), layout, blank


def _scan_table(path: Path, index_dir: Path, stat) -> tuple[np.ndarray, bytearray, array, str, _Layout, dict]:
    """The same from a parquet file / datasets folder; offsets are running title + text byte counts."""
    quiet = stat.st_size < _PROGRESS_MIN_BYTES or os.environ.get("RANK", "0") != "0"
    with tqdm(unit="rows", desc=f"indexing {path.name}", disable=quiet) as bar:
        scan = scan_arrow(path, index_dir, bar.update)
    offsets = np.zeros(len(scan.lengths) + 1, dtype=np.int64)
    np.cumsum(scan.lengths, out=offsets[1:])
    return offsets, scan.id_blob, array("I", scan.id_lengths.tobytes()), scan.fingerprint, _Layout(
        "arrow", arrow=scan.columns), scan.blank


def _build_index(path: Path, index_dir: Path, stat) -> None:
    """Scan the source once (validating every row) and write the memmappable index."""
    try:
        _write_index(path, index_dir, stat)
    except DataError:  # a bad source leaves no index (nor a parquet conversion) a later run could trust
        shutil.rmtree(index_dir / "arrow", ignore_errors=True)
        if index_dir.is_dir() and not any(index_dir.iterdir()):
            index_dir.rmdir()
        raise


def _write_index(path: Path, index_dir: Path, stat) -> None:
    if is_arrow_source(path):
        offsets_np, id_blob, id_lengths, fingerprint, layout, blank = _scan_table(path, index_dir, stat)
    else:
        offsets_np, id_blob, id_lengths, fingerprint, layout, blank = _scan_lines(path, stat)
    after = source_stat(path)
    if (after.st_size, after.st_mtime_ns) != (stat.st_size, stat.st_mtime_ns):
        raise data_error(path, None, None, "the source changed while it was being indexed")

    ids = _fixed_width(id_blob, id_lengths)
    del id_blob
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    duplicates = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if duplicates.size:
        first, second = sorted(int(r) for r in order[duplicates[0]: duplicates[0] + 2])
        message = (f"duplicate passage id {ids[second].decode()!r} (first seen on %s); "
                   f"{duplicates.size} duplicate(s) in all")
        if layout.kind == "arrow":
            raise data_error(row_ref(path, second), None, "id", message % f"row {first}")
        raise data_error(path, _line_number(path, int(offsets_np[second])), "id",
                         message % f"line {_line_number(path, int(offsets_np[first]))}")

    index_dir.mkdir(parents=True, exist_ok=True)
    for name, values in zip(_ARRAYS, (offsets_np, ids, sorted_ids, order.astype(np.int64))):
        with atomic_open(index_dir / f"{name}.npy", "wb") as out:
            np.save(out, values)
    atomic_write_json(index_dir / "meta.json", {
        "version": INDEX_VERSION, "source": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "rows": len(ids), "id_width": ids.dtype.itemsize, "fingerprint": fingerprint,
        "layout": asdict(layout), "blank_passages": blank,
    })


def _default_index_dir(path: Path, cache_dir: Optional[str | Path]) -> Path:
    """`<file>.index/` beside the file; under `cache_dir` (or the user cache) when given / read-only."""
    if cache_dir is None and os.access(path.parent, os.W_OK):
        return path.parent / f"{path.name}.index"
    root = Path(cache_dir) if cache_dir is not None else Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rag_train" / "corpus-index"
    tag = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    return root / f"{path.name}.{tag}.index"


class Corpus:
    """Passages by row (0..N-1, file order) and by id, read lazily from the source file."""

    def __init__(self, path: Path, index_dir: Path) -> None:
        meta_path = index_dir / "meta.json"
        self.path, self.index_dir = path, index_dir
        self._meta = json.loads(meta_path.read_text(encoding="utf-8"))
        self._layout = _Layout(**self._meta["layout"])
        arrays = {name: np.load(index_dir / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
        self._offsets, self._ids = arrays["offsets"], arrays["ids"]
        self._sorted_ids, self._order = arrays["sorted_ids"], arrays["order"]
        rows = self._meta["rows"]
        if len(self._offsets) != rows + 1 or len(self._ids) != rows or len(self._order) != rows:
            raise data_error(meta_path, None, "rows", f"index arrays do not hold {rows} rows; delete {index_dir}")
        self._fd, self._fd_pid = -1, -1
        self._table = ArrowRows(path, index_dir, self._layout.arrow) if self._layout.kind == "arrow" else None
        if self._table is not None and len(self._table) != rows:
            raise data_error(meta_path, None, "rows", f"the source no longer holds {rows} rows; delete {index_dir}")

    @classmethod
    def open(cls, path: str | Path, cache_dir: Optional[str | Path] = None) -> "Corpus":
        """Open `path`, building (or rebuilding, if the source's size / mtime changed) its index first."""
        path = Path(path)
        if not path.exists():
            raise data_error(path, None, None, "passages file not found")
        stat = source_stat(path)
        index_dir = _default_index_dir(path, cache_dir)
        if not cls._index_is_current(index_dir, stat):
            _build_index(path, index_dir, stat)
        corpus = cls(path, index_dir)
        blank = corpus._meta["blank_passages"]
        if blank["count"]:
            warnings.warn(f"{path}: {blank['count']} passage(s) with blank text (the first: id "
                          f"{blank['first_id']!r}); they are kept but can only be found by their title",
                          BlankPassagesWarning, stacklevel=2)
        return corpus

    @staticmethod
    def _index_is_current(index_dir: Path, stat) -> bool:
        try:
            meta = json.loads((index_dir / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        current = (meta.get("version"), meta.get("size"), meta.get("mtime_ns"))
        converted = ((meta.get("layout") or {}).get("arrow") or {}).get("arrow_files", [])
        return current == (INDEX_VERSION, stat.st_size, stat.st_mtime_ns) and all(
            (index_dir / name).is_file() for name in [f"{a}.npy" for a in _ARRAYS] + converted)

    # Pickling (DataLoader workers, spawn) must not copy the memmaps: reopen from the index instead.
    def __getstate__(self) -> dict:
        return {"path": self.path, "index_dir": self.index_dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["index_dir"])

    def __len__(self) -> int:
        return int(self._meta["rows"])

    def __repr__(self) -> str:
        return f"Corpus({str(self.path)!r}, rows={len(self)})"

    @property
    def fingerprint(self) -> str:
        """sha256 of the source file's bytes (a datasets folder: of its Arrow files, in order); ties buffers
        and checkpoints to this exact corpus."""
        return self._meta["fingerprint"]

    def id(self, row: int) -> str:
        return self._ids[self._check_row(row)].decode("utf-8")

    def row(self, pid: str | int) -> int:
        return int(self.rows([pid])[0])

    def rows(self, pids: Iterable[str | int]) -> np.ndarray:
        """Rows of passage ids (int64); DataError naming the first unknown id."""
        keys = [str(p).strip() for p in pids]  # as the corpus' own ids are read
        found, slots = self._lookup(keys)
        if not found.all():
            missing = [k for k, ok in zip(keys, found) if not ok]
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise data_error(self.path, None, "id", f"unknown passage id {missing[0]!r}{more}")
        return np.asarray(self._order[slots], dtype=np.int64)

    def contains(self, pids: Iterable[str | int]) -> np.ndarray:
        """Whether each id is in the corpus (bool array), for callers that report their own errors."""
        return self._lookup([str(p).strip() for p in pids])[0]

    def _lookup(self, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Binary search of the memmapped sorted ids: (found mask, slot in the sorted order)."""
        if not keys:
            return np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64)
        encoded = [k.encode("utf-8") for k in keys]
        width = self._sorted_ids.dtype.itemsize
        fits = np.array([len(k) <= width and b"\x00" not in k for k in encoded])
        probe = np.array([k if ok else b"" for k, ok in zip(encoded, fits)], dtype=f"S{width}")
        slots = np.minimum(np.searchsorted(self._sorted_ids, probe), len(self) - 1)
        return fits & (self._sorted_ids[slots] == probe), slots

    def title(self, row: int) -> str:
        return self._record(row)[1]

    def text(self, row: int) -> str:
        return self._record(row)[2]

    def passage(self, row: int) -> dict:
        pid, title, text = self._record(row)
        return {"id": pid, "title": title, "text": text}

    def passages(self, rows: Iterable[int]) -> list[dict]:
        return [self.passage(int(r)) for r in rows]

    def byte_lengths(self) -> np.ndarray:
        """Bytes per row's line: a cheap length proxy for length-sorted batching without reading text."""
        return np.diff(self._offsets)

    def close(self) -> None:
        if self._fd >= 0 and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd, self._fd_pid = -1, -1

    def __del__(self) -> None:
        try:
            self.close()
        except (AttributeError, OSError):
            pass

    def _check_row(self, row: int) -> int:
        row = int(row)
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range for {self.path} ({len(self)} rows)")
        return row

    def _record(self, row: int) -> tuple[str, str, str]:
        row = self._check_row(row)
        if self._table is not None:
            return (self.id(row), *self._table.title_text(row))
        if self._fd_pid != os.getpid():  # a forked worker must not share the parent's file position
            self._fd, self._fd_pid = os.open(self.path, os.O_RDONLY), os.getpid()
        start, end = int(self._offsets[row]), int(self._offsets[row + 1])
        raw = os.pread(self._fd, end - start, start)
        return _parse(self._layout, raw.decode("utf-8"), self.path, None)


__all__ = ["BlankPassagesWarning", "Corpus", "DataError"]

"""Passages from a parquet file or a `datasets.save_to_disk` folder, read as memory-mapped Arrow.

A `save_to_disk` folder is already Arrow: it is memory-mapped as it is, no conversion. A parquet file's
pages are compressed, so it cannot be read by row in place: `datasets` converts it once into an Arrow file
kept in the corpus index directory (the parquet counterpart of the JSONL line scan), memory-mapped after.

Columns are found by name as in a TSV header: id (`id`, `_id`, `pid`, `docid`, `doc_id`; string or integer),
text (`text`, `passage`, `contents`; string), optional title (`title`; string, null read as ""). Every row is
checked with the JSONL path's rules; errors name the file, the row (0-based, the corpus row) and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from rag_train.data.errors import data_error, row_ref

ID_COLUMNS = ("id", "_id", "pid", "docid", "doc_id")
TEXT_COLUMNS = ("text", "passage", "contents")
TITLE_COLUMNS = ("title",)
_BATCH_ROWS = 1 << 16


def is_arrow_source(path: Path) -> bool:
    """A parquet file or a folder (which must then be a `datasets.save_to_disk` one)."""
    return path.is_dir() or path.suffix.lower() == ".parquet"


@dataclass(frozen=True)
class SourceStat:
    """Size and modification time of a source (a folder: all its files), to tell a stale index."""

    st_size: int
    st_mtime_ns: int


def source_stat(path: Path) -> SourceStat:
    if not path.is_dir():
        stat = path.stat()
        return SourceStat(stat.st_size, stat.st_mtime_ns)
    stats = [p.stat() for p in sorted(path.rglob("*")) if p.is_file()]
    return SourceStat(sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0))


def load_folder(path: Path):
    """The memory-mapped `datasets.Dataset` saved in `path` (one split: a DatasetDict is refused, naming its splits).
    A damaged folder (state.json missing or unreadable, an Arrow file missing or truncated) is a DataError naming
    the file at fault, not an error from inside datasets / pyarrow."""
    import datasets

    state = path / "state.json"
    if not state.is_file() and not (path / "dataset_dict.json").is_file():
        leftovers = sorted(p.name for p in path.glob("*.arrow")) + (["dataset_info.json"]
                                                                    if (path / "dataset_info.json").is_file() else [])
        if leftovers:  # the rest of a save_to_disk folder is there: it lost its state.json
            raise data_error(state, None, None, f"missing, though {path} holds {', '.join(leftovers[:3])}: a damaged "
                                                "datasets.save_to_disk folder; save the dataset again")
        raise data_error(path, None, None, "a folder must be a datasets.save_to_disk folder "
                                           "(state.json and data-*.arrow files)")
    files: list[str] = []
    if state.is_file():
        try:
            files = [entry["filename"] for entry in json.loads(state.read_bytes().decode("utf-8"))["_data_files"]]
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise data_error(state, None, "_data_files",
                             f"not readable ({type(exc).__name__}: {exc}): a damaged "
                             "datasets.save_to_disk folder; save the dataset again") from None
        for name in files:
            if not (path / name).is_file():
                raise data_error(path / name, None, None, f"missing (listed in {state}): a damaged "
                                                          "datasets.save_to_disk folder; save the dataset again")
    try:
        loaded = datasets.load_from_disk(str(path))  # memory-mapped Arrow
    except Exception as exc:  # pyarrow, json, datasets: all mean the folder cannot be read as saved
        culprit = next((path / name for name in files if not _arrow_readable(path / name)), path)
        cause = (str(exc).strip().splitlines() or [""])[0][:200]
        raise data_error(culprit, None, None, f"cannot be read ({type(exc).__name__}: {cause}): a truncated or "
                                              "damaged datasets.save_to_disk folder; save the dataset again") from None
    if isinstance(loaded, datasets.DatasetDict):
        raise data_error(path, None, None, f"a DatasetDict with splits {sorted(loaded)}; give one split's folder, "
                                           f"e.g. {path / next(iter(loaded))}")
    return loaded


def _arrow_readable(path: Path) -> bool:
    """Whether an Arrow stream file (as save_to_disk writes them) reads to its end."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            pa.ipc.open_stream(source).read_all()
        return True
    except (pa.ArrowException, OSError, ValueError):
        return False


def open_dataset(path: Path, arrow_files: list[str], index_dir: Path):
    """The memory-mapped `datasets.Dataset` of a source (a parquet file through its converted Arrow files)."""
    import datasets

    if path.is_dir():
        return load_folder(path)
    parts = [datasets.Dataset.from_file(str(index_dir / name)) for name in arrow_files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _convert_parquet(path: Path, index_dir: Path) -> tuple[object, list[str]]:
    """parquet -> Arrow files under `<index>/arrow` (one pass by `datasets`); (dataset, files relative to index)."""
    import datasets
    import pyarrow.lib
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pyarrow.lib.ArrowException, OSError) as exc:
        raise data_error(path, None, None, f"not a readable parquet file ({type(exc).__name__}: {exc})") from None
    if rows == 0:
        raise data_error(path, None, None, "no passages (the dataset is empty)")
    target = index_dir / "arrow"
    shutil.rmtree(target, ignore_errors=True)  # a rebuilt index leaves no stale conversion behind
    try:
        dataset = datasets.Dataset.from_parquet(str(path), cache_dir=str(target))
    except (pyarrow.lib.ArrowException, OSError, ValueError, datasets.exceptions.DatasetGenerationError) as exc:
        raise data_error(path, None, None, f"not a readable parquet file ({type(exc).__name__}: {exc})") from None
    files = [os.path.relpath(f["filename"], index_dir) for f in dataset.cache_files]
    return dataset, files


def _column(names: list[str], wanted: tuple[str, ...]) -> Optional[str]:
    lowered = {name.lower(): name for name in names}
    return next((lowered[w] for w in wanted if w in lowered), None)


def _first(mask) -> Optional[int]:
    """Index of the first true value of a boolean Arrow array (nulls count as false)."""
    import pyarrow.compute as pc

    hits = np.flatnonzero(pc.fill_null(mask, False).to_numpy(zero_copy_only=False))
    return int(hits[0]) if hits.size else None


@dataclass
class ArrowScan:
    """What the index needs from a scan: lengths (for length-sorted batching), ids, fingerprint, layout."""

    lengths: np.ndarray  # int64[N]: UTF-8 bytes of title + text per row
    id_blob: bytearray
    id_lengths: np.ndarray  # uint32[N]
    fingerprint: str
    columns: dict  # {"id_name", "text_name", "title_name", "arrow_files"}
    blank: dict  # passages whose text is empty or whitespace: {"count", "first_id"}


def scan_arrow(path: Path, index_dir: Path, progress: Callable[[int], None] = lambda rows: None) -> ArrowScan:
    """Validate every row of a parquet file / datasets folder and collect its ids and lengths."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if path.is_dir():
        dataset, arrow_files = load_folder(path), []
    else:
        dataset, arrow_files = _convert_parquet(path, index_dir)
    names = list(dataset.column_names)
    id_name, text_name, title_name = (_column(names, ID_COLUMNS), _column(names, TEXT_COLUMNS),
                                      _column(names, TITLE_COLUMNS))
    if id_name is None:
        raise data_error(path, None, "id", f"no id column (one of {ID_COLUMNS}); columns are {names}")
    if text_name is None:
        raise data_error(path, None, "text", f"no text column (one of {TEXT_COLUMNS}); columns are {names}")
    table = dataset.data.table.select([c for c in (id_name, text_name, title_name) if c is not None])
    schema = table.schema
    id_type = schema.field(id_name).type
    if not (pa.types.is_string(id_type) or pa.types.is_large_string(id_type) or pa.types.is_integer(id_type)):
        raise data_error(path, None, id_name, f"column type {id_type}; expected string or integer ids")
    for name in (text_name, title_name):
        if name is not None and not (pa.types.is_string(schema.field(name).type)
                                     or pa.types.is_large_string(schema.field(name).type)):
            raise data_error(path, None, name, f"column type {schema.field(name).type}; expected string")
    if table.num_rows == 0:
        raise data_error(path, None, None, "no passages (the dataset is empty)")

    lengths, id_lengths, id_blob, start = [], [], bytearray(), 0
    blank = {"count": 0, "first_id": None}  # passages whose text is empty or whitespace
    for batch in table.to_batches(max_chunksize=_BATCH_ROWS):
        ids, text = batch.column(id_name), batch.column(text_name)
        for name, values in ((id_name, ids), (text_name, text)):
            bad = _first(values.is_null())
            if bad is not None:
                raise data_error(row_ref(path, start + bad), None, name, "null")
        ids = pc.utf8_trim_whitespace(pc.cast(ids, pa.large_string()))  # as ids of JSONL / TSV sources
        bad = _first(pc.equal(pc.utf8_length(ids), 0))
        if bad is not None:
            raise data_error(row_ref(path, start + bad), None, id_name, "empty passage id")
        bad = _first(pc.or_(pc.match_substring(ids, "\n"), pc.match_substring(ids, "\x00")))
        if bad is not None:
            raise data_error(row_ref(path, start + bad), None, id_name, "passage id contains a newline or NUL byte")
        empty = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(text)), 0)
        if _first(empty) is not None:
            blank["first_id"] = blank["first_id"] or ids[_first(empty)].as_py()
            blank["count"] += int(pc.sum(empty).as_py())
        size = pc.binary_length(text).to_numpy(zero_copy_only=False).astype(np.int64)
        if title_name is not None:
            size += pc.fill_null(pc.binary_length(batch.column(title_name)), 0).to_numpy(zero_copy_only=False)
        lengths.append(size)
        offsets = np.frombuffer(ids.buffers()[1], dtype=np.int64)[ids.offset : ids.offset + len(ids) + 1]
        id_blob += memoryview(ids.buffers()[2])[int(offsets[0]) : int(offsets[-1])]
        id_lengths.append(np.diff(offsets).astype(np.uint32))
        start += batch.num_rows
        progress(batch.num_rows)

    digest = hashlib.sha256()  # the source's own bytes, as for JSONL / TSV (folder: its Arrow files in order)
    for source in ([Path(f["filename"]) for f in dataset.cache_files] if path.is_dir() else [path]):
        with open(source, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return ArrowScan(np.concatenate(lengths), id_blob, np.concatenate(id_lengths), digest.hexdigest(),
                     {"id_name": id_name, "text_name": text_name, "title_name": title_name,
                      "arrow_files": arrow_files}, blank)


def table_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(row, record) of a small table (QA / query sets) from a parquet file or a datasets folder."""
    if path.is_dir():
        yield from enumerate(load_folder(path))
        return
    import pyarrow.lib
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches()
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                yield row, record
                row += 1
    except (pyarrow.lib.ArrowException, OSError) as exc:
        raise data_error(path, None, None, f"not a readable parquet file ({type(exc).__name__}: {exc})") from None


class ArrowRows:
    """(title, text) by row from the memory-mapped columns."""

    def __init__(self, path: Path, index_dir: Path, columns: dict) -> None:
        table = open_dataset(path, columns["arrow_files"], index_dir).data.table
        self._text = table.column(columns["text_name"])
        self._title = table.column(columns["title_name"]) if columns["title_name"] else None

    def __len__(self) -> int:
        return len(self._text)

    def title_text(self, row: int) -> tuple[str, str]:
        title = self._title[row].as_py() if self._title is not None else None
        return title or "", self._text[row].as_py()

"""One error type for bad input data, so callers can catch it and users see where to look."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and, where known, line and field."""


def data_error(path: str | Path, line: Optional[int], field: Optional[str], msg: str) -> DataError:
    """Build a DataError reading `path:line: field 'f': msg` (line / field left out when None)."""
    where = str(path) if line is None else f"{path}:{line}"
    what = f" field '{field}':" if field is not None else ""
    return DataError(f"{where}:{what} {msg}")


def row_ref(path: str | Path, row: int) -> str:
    """Where a bad record of a table (parquet / datasets) is: `path: row N`, N 0-based as the corpus row;
    pass it as `data_error`'s path with no line."""
    return f"{path}: row {row}"

"""Crash-safe file writing and checksums: everything kept for later is written to a temporary file,
fsynced and renamed into place, so a reader never sees a half-written file under its final name.

Folders written for later use (checkpoints, saved models) carry a checksum record of their files
(`folder_checksums`), and readers check it (`verify_checksums`) so that a truncated or altered file is
reported by name instead of surfacing as a deserialisation error deep inside a loader."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[Any]:
    """Open a temporary file beside `path`; on clean exit fsync and rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give them the usual permissions
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class CorruptFileError(ValueError):
    """A file written for later use that is missing, truncated or altered; the message names the file."""


class StorageError(OSError):
    """A write that failed for lack of space (or quota); the message names the file or folder and the disk."""


TMP_DIR_SUFFIX = ".partial"  # `atomic_directory`'s folder being filled: `.NAME.XXXXXXXX.partial`


def remove_stale_temporaries(directory: str | Path) -> None:
    """Remove what killed writers left in `directory`: `atomic_open` files (`.NAME.XXXXXXXX.tmp`) and
    `atomic_directory` folders (`.NAME.XXXXXXXX.partial`). Call it only where no other writer is active."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in directory.glob(".*.*"):
        if path.is_file() and path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)
        elif path.is_dir() and path.name.endswith(TMP_DIR_SUFFIX):
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on clean exit its files are fsynced and it replaces `path`
    (an existing folder is swapped out only once the new one is complete). On error the temporary folder is
    removed. A kill between the two renames leaves the previous folder as `.NAME.old`; the next call
    puts it back first, so a finished folder is never lost. A kill while filling leaves `.NAME.XXXXXXXX.partial`,
    which the next call for the same `path` removes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.with_name(f".{path.name}.old")
    if old.exists() and not path.exists():
        os.replace(old, path)
    for stale in path.parent.glob(f".{path.name}.*{TMP_DIR_SUFFIX}"):  # left by a killed writer of this folder
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=TMP_DIR_SUFFIX, dir=path.parent))
    os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes 0700 folders; a saved model gets the usual permissions
    try:
        yield tmp
        fsync_tree(tmp)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fsync_tree(directory: str | Path) -> None:
    """fsync every file and folder under `directory` (before it is renamed into place)."""
    directory = Path(directory)
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as handle:
        handle.write(text)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def folder_checksums(directory: str | Path, exclude: tuple[str, ...] = ()) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of every file under `directory` (sorted; `exclude` names skipped)."""
    directory = Path(directory)
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel in exclude:
            continue
        out[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return out


def verify_checksums(directory: str | Path, files: dict[str, dict], record: str | Path) -> None:
    """CorruptFileError naming the first file under `directory` that is missing, truncated or altered
    with respect to `files` (as written by `folder_checksums`; `record` names where they were read from)."""
    directory = Path(directory)
    for rel, expected in files.items():
        path = directory / rel
        if not path.is_file():
            raise CorruptFileError(f"{path}: missing (listed in {record})")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CorruptFileError(f"{path}: {size} bytes, {record} says {expected['bytes']} (truncated or "
                                   "overwritten)")
        if sha256_file(path) != expected["sha256"]:
            raise CorruptFileError(f"{path}: sha256 does not match {record} (the file is corrupt or was replaced)")


def read_json(path: str | Path) -> Any:
    """A JSON file written by this package; CorruptFileError naming it when it is missing or unreadable."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        line = f":{exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise CorruptFileError(f"{path}{line}: not valid JSON, the file is truncated or corrupt ({exc})") from None

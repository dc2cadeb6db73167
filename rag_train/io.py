"""Crash-safe file writing and checksums: everything kept for later is written to a temporary file,
fsynced and renamed into place, so a reader never sees a half-written file under its final name.

Folders written for later use (checkpoints, saved models) carry a checksum record of their files
(`folder_checksums`), and readers check it (`verify_checksums`) so that a truncated or altered file is
reported by name instead of surfacing as a deserialisation error deep inside a loader."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb", needed: Optional[int] = None) -> Iterator[Any]:
    """Open a temporary file beside `path`; on clean exit fsync and rename it to `path`. A write that fails for
    lack of space or permission raises StorageError naming `path`, the space it needed (`needed` bytes when
    the caller knows it, else what was written before the failure) and what is free; the temporary file is
    removed and a previous `path` is left as it was."""
    path = Path(path)
    tmp, written = None, [0]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give them the usual permissions
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            written[0] = handle.tell() if handle.seekable() else 0
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as exc:
        if tmp is not None and os.path.exists(tmp):
            try:
                written[0] = written[0] or os.path.getsize(tmp)
            except OSError:
                pass
            os.unlink(tmp)
        if isinstance(exc, Exception) and not isinstance(exc, StorageError) and write_fault(exc):
            raise storage_error("writing", path, exc, needed, written=written[0]) from exc
        raise


class CheckError(Exception):
    """A benchmark's or report's results disagree with their own reference: no figures (exit status 1)."""


class CorruptFileError(ValueError):
    """A file written for later use that is missing, truncated or altered; the message names the file."""


class StorageError(OSError):
    """A write that failed for lack of space (full disk, quota, file size limit) or of permission (read-only
    filesystem or folder); the message names the file or folder, the space needed and the space free."""


SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
PERMISSION_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
# how libraries that write by themselves report those errnos: safetensors and tokenizers (Rust: "... (os error 28)"),
# torch's zip writer (C++: "[enforce fail at inline_container.cc] ... file write failed" / "unexpected pos"), numpy's
# short write ("N requested and M written"); torch's C++ stream on a small file says "basic_ios::clear: iostream error"
_SPACE_TEXT = ("No space left on device", "(os error 28)", "(os error 27)", "(os error 122)", "File too large",
               "Disk quota exceeded", "StorageFull", "FileTooLarge", "QuotaExceeded")
_PERMISSION_TEXT = ("Permission denied", "(os error 13)", "Read-only file system", "(os error 30)",
                    "Operation not permitted", "(os error 1)", "ReadOnlyFilesystem")
_TORCH_WRITER_TEXT = ("file write failed", "inline_container", "PytorchStreamWriter", "unexpected pos",
                      "iostream error")


def write_fault(exc: BaseException) -> Optional[str]:
    """"space" / "permission" when `exc` (or an exception it was raised from) is a write that failed for lack
    of space / of permission, as the OS, safetensors, tokenizers, torch or numpy report it; else None. Meant for
    exceptions raised while writing (the torch and numpy texts are only read as a full disk there)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS:
            return "space"
        if isinstance(exc, OSError) and exc.errno in PERMISSION_ERRNOS:
            return "permission"
        if not isinstance(exc, OSError) or exc.errno is None:  # library errors carry the OS error as text
            text = str(exc)
            if any(marker in text for marker in _SPACE_TEXT):
                return "space"
            if any(marker in text for marker in _PERMISSION_TEXT):
                return "permission"
            if isinstance(exc, RuntimeError) and any(marker in text for marker in _TORCH_WRITER_TEXT):
                return "space"
            if isinstance(exc, OSError) and "requested and" in text and "written" in text:
                return "space"
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def size_text(size: Optional[int]) -> str:
    if size is None:
        return "an unknown amount"
    if size < 10 * 1024:
        return f"{size} bytes"
    if size < 10 * 2**20:
        return f"{size / 1024:.0f} KiB"
    return f"{size / 2**20:.1f} MiB" if size < 10 * 2**30 else f"{size / 2**30:.1f} GiB"


def free_space(path: str | Path) -> tuple[Path, Optional[int]]:
    """(nearest existing folder of `path`, bytes free to this user on its filesystem)."""
    place = Path(path)
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        stats = os.statvfs(place)
        return place, stats.f_bavail * stats.f_frsize
    except OSError:
        return place, None


def storage_error(what: str, path: str | Path, exc: BaseException, needed: Optional[int] = None,
                  written: int = 0, then: str = "") -> StorageError:
    """The StorageError for a write of `path` that failed with `exc` (a `write_fault`): one line naming the path,
    the cause, and for lack of space the space needed and free; `then` says how to carry on."""
    cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    place, free = free_space(path)
    if write_fault(exc) == "permission":
        message = (f"{what} {path} failed: not writable ({cause}); {place} is on a read-only filesystem or this user "
                   "may not write there. Nothing was left half-written; make it writable or choose another folder")
        code = errno.EACCES
    else:
        if needed:
            need = f"it needs about {size_text(needed)}"
        elif written:
            need = f"it needs more than the {size_text(written)} written before the failure"
        else:
            need = "it needs more space"
        message = (f"{what} {path} failed: no space left ({cause}); {need}, {size_text(free)} free on the "
                   f"filesystem of {place} (a full disk, quota or file size limit). Nothing was left half-written; "
                   "free space and run it again (a training run with train.resume=true: it continues from its last "
                   "checkpoint)")
        code = errno.ENOSPC
    error = StorageError(message + (f" ({then})" if then else "") + ".")
    error.errno = errno_of(exc) or code
    return error


def errno_of(exc: Optional[BaseException]) -> Optional[int]:
    """The errno of the first OSError in `exc`'s chain (the OS's own code: ENOSPC, EFBIG, EROFS, ...)."""
    for _ in range(8):
        if exc is None:
            return None
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


@contextmanager
def write_step(what: str, path: str | Path, needed: Optional[int] = None, then: str = "") -> Iterator[None]:
    """Around a write of `path` by code that is not `atomic_open` (a library's own file writer): a failure for
    lack of space or permission becomes a StorageError naming `path` (`storage_error`); others pass."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        if not write_fault(exc):
            raise
        raise storage_error(what, path, exc, needed, then=then) from exc


def state_bytes(*modules: Any) -> int:
    """Bytes of the tensors of `modules`' state dicts (shared tensors once): what saving their weights needs."""
    seen, total = set(), 0
    for module in modules:
        if module is None:
            continue
        for tensor in module.state_dict().values():
            key = (tensor.data_ptr(), tensor.numel())
            if key not in seen:
                seen.add(key)
                total += tensor.numel() * tensor.element_size()
    return total


def tree_size(directory: str | Path) -> int:
    """Bytes of every file under `directory` (0 when it does not exist)."""
    directory = Path(directory)
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0


def usual_modes(directory: str | Path) -> None:
    """Give every file under `directory` the umask's mode (0666 & ~umask): some writers (safetensors >= 0.8
    writes through a private temporary file) leave 0600 files, unreadable by the serving user or a group."""
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~_UMASK)


TMP_DIR_SUFFIX = ".partial"  # `atomic_directory`'s folder being filled: `.NAME.XXXXXXXX.partial`


def remove_stale_temporaries(directory: str | Path, recursive: bool = False) -> None:
    """Remove what killed writers left in `directory` (and its subfolders, `recursive`): `atomic_open` files
    (`.NAME.XXXXXXXX.tmp`) and `atomic_directory` folders (`.NAME.XXXXXXXX.partial`). Call it only where no other
    writer is active."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in list(directory.rglob(".*.*") if recursive else directory.glob(".*.*")):
        if path.is_file() and path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)
        elif path.is_dir() and path.name.endswith(TMP_DIR_SUFFIX):
            shutil.rmtree(path, ignore_errors=True)


def remove_temporaries_of(path: str | Path) -> None:
    """Remove what a killed `atomic_open` of `path` left beside it (`.NAME.XXXXXXXX.tmp`): for files whose writer is
    known not to be running now (a report rewritten in full by one process)."""
    path = Path(path)
    if path.parent.is_dir():
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)


@contextmanager
def atomic_directory(path: str | Path, what: str = "writing", needed: Optional[int] = None) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on clean exit its files are fsynced and it replaces `path`
    (an existing folder is swapped out only once the new one is complete). On error the temporary folder is
    removed. A kill between the two renames leaves the previous folder as `.NAME.old`; the next call
    puts it back first, so a finished folder is never lost. A kill while filling leaves `.NAME.XXXXXXXX.partial`,
    which the next call for the same `path` removes. A fill that fails for lack of space or permission raises
    StorageError naming `path` (`what` it was doing, the `needed` bytes when known, the space free); files get
    the umask's modes, whatever their writer chose."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        old = path.with_name(f".{path.name}.old")
        if old.exists() and not path.exists():
            os.replace(old, path)
        for stale in path.parent.glob(f".{path.name}.*{TMP_DIR_SUFFIX}"):  # left by a killed writer of this folder
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=TMP_DIR_SUFFIX, dir=path.parent))
        os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes 0700 folders; a saved model gets the usual permissions
        yield tmp
        usual_modes(tmp)
        fsync_tree(tmp)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(path.parent)
    except BaseException as exc:
        if isinstance(exc, Exception) and not isinstance(exc, StorageError) and write_fault(exc):
            written = tree_size(tmp) if tmp is not None else 0
            error = storage_error(what, path, exc, needed, written=written)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error from exc
        raise
    finally:
        if tmp is not None:
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
    with atomic_open(path, "w", needed=len(text.encode("utf-8"))) as handle:
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


MODEL_CHECKSUMS = "checksums.json"  # beside a saved model's files: their sha256 and size (`record_model_files`)
MODEL_RECORDS = (MODEL_CHECKSUMS, "toy_lm.json")  # the records of a saved model's files: ours, the toy LM stage's


def record_model_files(directory: str | Path, exclude: tuple[str, ...] = ()) -> None:
    """Write `checksums.json`: the sha256 and size of every file already in `directory` (a saved model, before it
    is renamed into place), which `verify_model_files` checks before the model is loaded."""
    directory = Path(directory)
    atomic_write_json(directory / MODEL_CHECKSUMS, {"files": folder_checksums(directory, exclude=(MODEL_CHECKSUMS,
                                                                                                  *exclude))})


def model_records(directory: Path) -> Iterator[tuple[Path, dict[str, dict]]]:
    """(record file, {relative path: {"bytes", "sha256"}}) of each record saved with a model folder's files."""
    for name in MODEL_RECORDS:
        record = directory / name
        if record.is_file():
            files = read_json(record).get("files")
            if isinstance(files, dict):
                yield record, files


def verify_model_files(directory: str | Path) -> None:
    """CorruptFileError naming the first file of a saved model that is missing, truncated or altered with respect to
    the record saved with it, so that a damaged weight file is named instead of loading as a model that outputs
    nothing. A folder without a record (a Hugging Face download) passes."""
    directory = Path(directory)
    for record, files in model_records(directory):
        verify_checksums(directory, files, record)


def model_digest(name_or_path: Optional[str | Path]) -> Optional[str]:
    """One sha256 naming a local model folder's contents: of its files' {relative path: sha256}, read from the record
    saved with them (`checksums.json`, `toy_lm.json`) or, without one, hashed here, so a folder gives the same digest
    with or without its record. Two runs compared as starting from the same init must show the same digest: a model
    rebuilt from the same recipe on another machine can differ in its last bits. None for a hub name or no model."""
    directory = Path(name_or_path) if name_or_path else None
    if directory is None or not directory.is_dir():
        return None
    files = next((files for _, files in model_records(directory)), None)
    if files is None:
        files = folder_checksums(directory, exclude=MODEL_RECORDS)
    listing = json.dumps({rel: entry["sha256"] for rel, entry in files.items()}, sort_keys=True)
    return hashlib.sha256(listing.encode()).hexdigest()


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

"""Write-level fault injection for the fault matrix (tests/fault_matrix.py).

Every write an entry point makes under a root folder is an *event*: a file opened for writing (`os.open`,
`open` / `io.open`: atomic_open's temporary files, numpy, json, configs), a safetensors file
(`safetensors.torch.serialize_file`), a torch file (`torch.save` to a path) or a tokenizer file
(`TokenizersBackend._save_pretrained`). Events are counted in one log shared by every process of a cell (a
script's launched runs too: `install_from_env`, through tests/fault_site/sitecustomize.py), and each gets a
*site*: its path under the root with temporary names turned into final ones and numbers into N
(`checkpoints/step-N/model.safetensors`, `buffer/shard-N.npy`).

At the chosen event (`at`: its index, or `site`: the first event of that site) the injector
  * `enospc`: makes that write fail as on a full disk: an opened file's descriptor is replaced by /dev/full (the
    kernel answers every write with ENOSPC, and the writer reports it its own way), a torch or tokenizer file is
    written through a link to /dev/full (their own errors), safetensors (which writes through a private temporary
    file) raises the SafetensorError it raises on a full disk;
  * `kill`: SIGKILLs the cell's whole process group once that file is open (or, for library writers, written);
  * `readonly`: (at every event) raises what a read-only filesystem gives (EROFS), for where a real read-only
    folder cannot be made;
  * `term`: sends the writing process SIGTERM (a scheduler preempting it) and lets the write go on.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import signal
from pathlib import Path
from typing import Optional

ENV = "RAG_FAULT_INJECT"  # JSON of Injector's arguments, for the processes a cell launches
_REAL_OS_OPEN = os.open
_REAL_OPEN = builtins.open


def site_of(root: str, path: str) -> str:
    """The site of a write of `path` under `root`: relative path, temporary names made final, numbers as N."""
    rel = os.path.relpath(path, root)
    parts = []
    for part in rel.split(os.sep):
        part = re.sub(r"^\.(.+)\.[A-Za-z0-9_]{8}\.(tmp|partial)$", r"\1", part)  # atomic_open / atomic_directory
        part = re.sub(r"^\.tmp-(step-\d+)$", r"\1", part)  # a checkpoint being written
        part = re.sub(r"^\.(.+)\.old$", r"\1", part)
        parts.append(re.sub(r"\d+", "N", part))
    return "/".join(parts)


class Injector:
    def __init__(self, root: str, log: str, mode: str = "record", at: Optional[int] = None,
                 site: Optional[str] = None):
        self.root, self.log, self.mode, self.at, self.site = os.path.abspath(root), log, mode, at, site
        self.fired = False

    def to_env(self) -> str:
        return json.dumps({"root": self.root, "log": self.log, "mode": self.mode, "at": self.at, "site": self.site})

    def event(self, kind: str, path) -> Optional[str]:
        """Count a write of `path`; the action to take at it: None, "enospc", "kill" or "readonly"."""
        try:
            path = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return None
        if not (path + os.sep).startswith(self.root + os.sep):
            return None
        site = site_of(self.root, path)
        fd = _REAL_OS_OPEN(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{kind}\t{site}\t{path}\n".encode())
        finally:
            os.close(fd)
        with _REAL_OPEN(self.log, "rb") as handle:
            index = sum(1 for _ in handle)
        if self.mode == "readonly":
            return "readonly"
        if self.fired or self.mode == "record":
            return None
        if index == self.at or (self.at is None and site == self.site):
            self.fired = True
            with _REAL_OPEN(self.log + ".fired", "w") as handle:
                handle.write(json.dumps({"index": index, "kind": kind, "site": site, "path": path}))
            if self.mode == "term":
                os.kill(os.getpid(), signal.SIGTERM)
                return None
            return self.mode
        return None


def events(log: str) -> list[dict]:
    """The events a cell's log holds, in order: {"kind", "site", "path"}."""
    if not os.path.exists(log):
        return []
    with _REAL_OPEN(log, encoding="utf-8") as handle:
        return [dict(zip(("kind", "site", "path"), line.rstrip("\n").split("\t"))) for line in handle]


def _die() -> None:
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def _full(fd: int) -> None:
    """Point `fd` at /dev/full: every later write on it fails with ENOSPC."""
    full = _REAL_OS_OPEN("/dev/full", os.O_WRONLY)
    os.dup2(full, fd)
    os.close(full)


def _readonly(path) -> PermissionError:
    return PermissionError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(os.fspath(path)))


def _through_dev_full(path, write):
    """Run `write()` (a library writing `path` itself) with `path` a link to /dev/full; leave an empty file."""
    path = os.fsdecode(os.fspath(path))
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink("/dev/full", path)
    try:
        return write()
    finally:
        if os.path.islink(path):
            os.unlink(path)
            _REAL_OPEN(path, "wb").close()


def install(injector: Injector) -> None:
    """Patch the writers (once per process)."""
    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is None and flags & (os.O_WRONLY | os.O_RDWR):
            action = injector.event("open", path)
            if action == "readonly":
                raise _readonly(path)
            fd = _REAL_OS_OPEN(path, flags, mode)
            if action == "enospc":
                _full(fd)
            elif action == "kill":
                _die()
            return fd
        return _REAL_OS_OPEN(path, flags, mode, dir_fd=dir_fd)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            action = injector.event("open", file)
            if action == "readonly":
                raise _readonly(file)
            handle = _REAL_OPEN(file, mode, *args, **kwargs)
            if action == "enospc":
                _full(handle.fileno())
            elif action == "kill":
                _die()
            return handle
        return _REAL_OPEN(file, mode, *args, **kwargs)

    os.open = os_open
    builtins.open = io.open = open_

    import safetensors.torch
    from safetensors import SafetensorError

    real_serialize = safetensors.torch.serialize_file

    def serialize_file(tensors, filename, *args, **kwargs):
        action = injector.event("safetensors", filename)
        if action == "readonly":
            raise SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30)")
        if action == "enospc":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        out = real_serialize(tensors, filename, *args, **kwargs)
        if action == "kill":
            _die()
        return out

    safetensors.torch.serialize_file = serialize_file

    import torch

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, bytes, os.PathLike)):
            return real_save(obj, f, *args, **kwargs)
        action = injector.event("torch", f)
        if action == "readonly":
            raise RuntimeError(f"File {os.fsdecode(os.fspath(f))} cannot be opened: Read-only file system")
        if action == "enospc":
            return _through_dev_full(f, lambda: real_save(obj, f, *args, **kwargs))
        out = real_save(obj, f, *args, **kwargs)
        if action == "kill":
            _die()
        return out

    torch.save = save

    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its tokenizer files are not injected
        return
    real_tokenizer_save = TokenizersBackend._save_pretrained

    def tokenizer_save(self, save_directory, file_names, legacy_format=None, filename_prefix=None):
        path = os.path.join(str(save_directory), (filename_prefix + "-" if filename_prefix else "") + "tokenizer.json")
        action = injector.event("tokenizer", path)
        if action == "readonly":
            raise Exception(f"Read-only file system (os error 30): {path}")
        call = lambda: real_tokenizer_save(self, save_directory, file_names, legacy_format, filename_prefix)  # noqa
        if action == "enospc":
            return _through_dev_full(path, call)
        out = call()
        if action == "kill":
            _die()
        return out

    TokenizersBackend._save_pretrained = tokenizer_save


def install_from_env() -> None:
    """In a process a cell launched (tests/fault_site/sitecustomize.py): install the cell's injector, if any."""
    spec = os.environ.get(ENV)
    if spec:
        install(Injector(**json.loads(spec)))


def fired(log: str) -> Optional[dict]:
    """The event the injector acted on ({"index", "kind", "site", "path"}), or None."""
    path = Path(log + ".fired")
    return json.loads(path.read_text()) if path.is_file() else None

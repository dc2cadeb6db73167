"""The command line: `key=value` parsing and exit statuses for every entry script (`parse_cli`,
`exit_on_fault`, `run_recipe`), and the `rag-train` console script (`rag-train export ...`, `rag-train serve ...`)."""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import errno
import json
import logging
import os
import sys
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Optional, TypeVar

from rag_train.config import ConfigError, load_config

T = TypeVar("T")
CHECK_FAILED_EXIT = 1  # a benchmark's own check failed (rag_train.io.CheckError): its figures are not written
INPUT_FAULT_EXIT = 2  # bad config, data, buffer, checkpoint, model path or export
NUMERICAL_FAULT_EXIT = 3  # the run stopped after too many non-finite / diverged steps
PEER_FAULT_EXIT = 4  # a collective failed: another process died, or hung past the collective timeout
STORAGE_FAULT_EXIT = 5  # a write failed for lack of space (full disk, quota, file size limit) or permission (read-only)
PREEMPTED_EXIT = 6  # SIGTERM / SIGUSR1: a training step or buffer shard finished and kept; rerunning continues
_PEER_FAILURE = ("Timed out", "timed out", "Connection reset by peer", "Connection closed by peer", "Broken pipe")


@contextmanager
def exit_on_fault() -> Iterator[None]:
    """For entry scripts: a known fault ends the process with `error: <message>` on stderr (the message names
    the file, line, field or key) and a non-zero status, without a traceback; a run stopped by a stop signal with
    its work kept (a training step's checkpoint, a buffer's finished shards) prints that one line and ends with
    PREEMPTED_EXIT; anything else propagates."""
    from rag_train.data.errors import DataError
    from rag_train.io import CheckError, CorruptFileError, StorageError

    prefix = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""

    def stop(message: str, status: int, exc: BaseException) -> None:
        _end_progress_bars()
        message = " ".join(line.strip() for line in message.splitlines() if line.strip())  # one line
        print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(status) from exc

    try:
        yield
    except _imported("rag_train.preemption:Preempted") as exc:
        _end_progress_bars()
        print(f"{prefix}{exc}", file=sys.stderr, flush=True)
        raise SystemExit(PREEMPTED_EXIT) from exc
    except (ConfigError, DataError, CorruptFileError, *_imported("rag_train.buffer.store:BufferError",
                                                              "rag_train.models.reader:ReaderLoadError",
                                                              "rag_train.serving.export:ExportError")) as exc:
        stop(str(exc), INPUT_FAULT_EXIT, exc)
    except FloatingPointError as exc:
        stop(str(exc), NUMERICAL_FAULT_EXIT, exc)
    except CheckError as exc:
        stop(str(exc), CHECK_FAILED_EXIT, exc)
    except OSError as exc:
        if isinstance(exc, StorageError) or exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
            where = "" if isinstance(exc, StorageError) or not exc.filename else f"{exc.filename}: "
            stop(f"{where}{exc}", STORAGE_FAULT_EXIT, exc)
        if isinstance(exc, PermissionError) and exc.filename:  # an input this user may not read
            stop(f"{exc.filename}: {exc.strerror or exc}", INPUT_FAULT_EXIT, exc)
        raise
    except RuntimeError as exc:  # torch.distributed reports a dead / hung peer as a RuntimeError from gloo / NCCL
        text = str(exc)
        if not any(marker in text for marker in _PEER_FAILURE):
            raise
        stop("a collective operation with the other processes failed: another process died, or hung longer than "
             "train.collective_timeout; stopping. The last checkpoint is intact (train.resume=true continues from "
             f"it). Cause: {text.splitlines()[0][:300]}", PEER_FAULT_EXIT, exc)


def _imported(*names: str) -> tuple[type, ...]:
    """The exception classes among `names` ("module:Class") whose module is loaded: one that is not cannot have been
    raised, and loading it to catch nothing would make every entry script pay for it (the reader's module loads
    transformers' T5, seconds of CPU, before a bad argument can be reported)."""
    pairs = (name.split(":") for name in names)
    return tuple(getattr(sys.modules[module], cls) for module, cls in pairs if module in sys.modules)


def _end_progress_bars() -> None:
    """Close the progress bars a fault interrupted, so that the `error:` line starts a line of its own instead
    of being appended to a bar's last redraw."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def parse_cli(schema: type[T], argv: Optional[list[str]] = None, description: str = "",
              default_config: Optional[str | Path] = None) -> T:
    """`script.py [--config FILE] [key=value ...]`; on a bad config print the reason and exit 2. `--help` ends with
    the alternatives of every plugged section (strategies, batching options) and the keys each reads."""
    sections = typing.get_type_hints(schema)  # the section classes (the schemas' annotations are strings)
    epilog = "\n\n".join(f"{spec.name}:\n{sections[spec.name].__doc__}" for spec in dataclasses.fields(schema)
                         if hasattr(sections[spec.name], "unread_keys")) or None
    parser = argparse.ArgumentParser(description=description or schema.__doc__, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=default_config, help=f"YAML config file (default: {default_config})")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    try:
        return load_config(schema, args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(INPUT_FAULT_EXIT) from exc



def run_recipe(schema: type[T], default_config: Path, train: Callable[[T], dict],
               report: Callable[[T, dict], None]) -> NoReturn:
    """The body of a training entry script: parse `[--config FILE] [key=value ...]`, train inside `exit_on_fault`,
    print the summary, and end the process (`end_process`: a clean end of a multi-process run)."""
    cfg = parse_cli(schema, sys.argv[1:], default_config=default_config)
    try:
        with exit_on_fault():
            report(cfg, train(cfg))
    except SystemExit as exc:  # a known fault: its status is kept
        end_process(exit_status(exc), together=getattr(exc.__cause__, "every_process", False))
    end_process(0)


def exit_status(exc: SystemExit) -> int:
    """The status `raise SystemExit(code)` gives the shell: an int as is, None 0, anything else 1."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def end_process(status: int = 0, together: bool = False) -> NoReturn:
    """Leave an entry script without interpreter teardown.

    gloo's process groups have no shutdown: `destroy_process_group()` leaves their threads alive, and DeepSpeed
    keeps its own clones of the world group (`deepspeed.utils.groups`) that Python frees only while the
    interpreter finalises. A gloo thread that takes the GIL then is killed with `pthread_exit`, whose unwind
    through a `noexcept` destructor ends in `std::terminate` ("terminate called without an active exception",
    SIGABRT) after all the work is done. So on success every rank meets every group in a barrier (no rank
    tears down while a peer still sends), the groups are destroyed, the atexit hooks run, output and logging
    are flushed, and the process ends with `os._exit`. An end every rank reaches alike (`together`: a stop agreed
    at the same boundary, an error all raise after the collective that told them; `rag_train.preemption`) ends the
    same way, its status kept: the barrier keeps a rank that got there first from exiting while a slower one still
    writes its last record or its line (a launcher stops the other ranks as soon as one exits non-zero). On any
    other fault a peer may be dead, so no collective is attempted: output is flushed and the status kept. A failed
    barrier still ends with `status`."""
    try:
        if status == 0 or together:
            _end_process_groups()
            atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing left to flush into
                pass
        os._exit(status)


def _end_process_groups() -> None:
    """Barrier on every process group this rank belongs to (the default one and every `new_group`, DeepSpeed's
    included, in creation order, which is the same on every rank), then destroy them all."""
    import gc

    import torch.distributed as dist

    gc.collect()  # the recipe's engine, models and optimizers are garbage by now: drop them before the groups
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _world

    for group in list(_world.pg_map):
        if dist.get_rank(group) >= 0:
            dist.barrier(group=group)
    dist.destroy_process_group()

def _export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run directory (holds config.yaml, metrics.json, retriever/)")
    parser.add_argument("--out", required=True, help="export directory to create")
    parser.add_argument("--faiss", default=None, metavar="FACTORY",
                        help="also embed the corpus into a FAISS index: 'Flat', 'IVF4096,PQ64', 'HNSW32', ...")
    parser.add_argument("--onnx", action="store_true", help="also export each tower to ONNX (onnx/<tower>.onnx)")
    parser.add_argument("--corpus", default=None, help="passages file (default: the one in the run's config)")
    parser.add_argument("--copy-corpus", action="store_true",
                        help="copy the passages file into the export (default: the manifest names its path)")
    parser.add_argument("--nprobe", type=int, default=32, help="IVF lists searched per query when serving")
    parser.add_argument("--batch-size", type=int, default=256, help="passages per encoder batch")
    parser.add_argument("--overwrite", action="store_true", help="replace a previous export in --out")


def _serve_args(parser: argparse.ArgumentParser) -> None:
    from rag_train.serving.serve import ServeLimits

    defaults = ServeLimits()
    parser.add_argument("--export", required=True, help="export directory (from export_retriever.py, with --faiss)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="cpu", help="device for the query encoder (cpu, cuda, cuda:1)")
    parser.add_argument("--max-queries", type=int, default=defaults.max_queries, help="questions per request")
    parser.add_argument("--max-query-chars", type=int, default=defaults.max_query_chars, help="characters per question")
    parser.add_argument("--max-k", type=int, default=defaults.max_k, help="passages per question")
    parser.add_argument("--max-batch-queries", type=int, default=defaults.max_batch_queries,
                        help="questions per encoder batch, summed over coalesced requests")
    parser.add_argument("--max-wait-ms", type=float, default=defaults.max_wait_ms,
                        help="how long a batch waits for further requests")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s, metavar="SECONDS",
                        help="a request's headers must arrive within this many seconds of their first byte (or of "
                             "the connection opening), its body within this many seconds of its headers (else 408); "
                             "the connection is then closed")
    parser.add_argument("--log-level", default="info")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="rag-train", description="Export and serve trained rag-train retrievers.")
    commands = parser.add_subparsers(dest="command", required=True)
    _export_args(commands.add_parser("export", help="export a run's retriever (sentence-transformers, FAISS, ONNX)"))
    _serve_args(commands.add_parser("serve", help="serve an export over HTTP: POST /search, GET /health"))
    args = parser.parse_args(argv)
    with exit_on_fault():
        if args.command == "export":
            from rag_train.serving.export import export_retriever

            manifest = export_retriever(args.run, args.out, args.faiss, args.onnx, args.corpus, args.copy_corpus,
                                        args.nprobe, args.batch_size, args.overwrite)
            print(json.dumps({key: manifest[key] for key in ("towers", "dim", "corpus", "faiss", "onnx")
                              if key in manifest}, indent=2))
        else:
            from rag_train.serving.serve import ServeLimits, serve

            for name in ("max_queries", "max_query_chars", "max_k", "max_batch_queries", "port"):
                if getattr(args, name) < 1:
                    parser.error(f"--{name.replace('_', '-')} must be at least 1")
            if not args.request_timeout > 0:
                parser.error("--request-timeout must be > 0")
            limits = ServeLimits(args.max_queries, args.max_query_chars, args.max_k, args.max_batch_queries,
                                 args.max_wait_ms, args.request_timeout)
            serve(args.export, args.host, args.port, limits, args.device, args.log_level)


if __name__ == "__main__":
    main()

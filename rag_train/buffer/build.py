"""Embed a corpus once into a stale buffer: distributed over processes, length-sorted, resumable.

Rows are cut into shards of `shard_rows`; each process encodes a contiguous range of shards. A finished
shard is written atomically with a small sidecar (`shard-NNNNN.json`: rows, dtype, fingerprints,
sha256), so a killed build restarts and skips every shard whose file still matches its sidecar. The
main process writes the final `manifest.json` (complete: true) after all processes are done. Given a `StopSignal`,
a build stops at the next shard boundary on SIGTERM / SIGUSR1 (every process at the same one), keeping every
finished shard for the rerun.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from rag_train.buffer.embed import CorpusPasses, embed_rows
from rag_train.buffer.store import (
    MANIFEST,
    STORAGE_DTYPES,
    Buffer,
    BufferError,
    manifest_dict,
    read_manifest,
    shard_file_name,
    to_storage,
    vectors_fingerprint,
    write_shard,
)
from rag_train.io import atomic_write_json, remove_stale_temporaries, sha256_file, write_step
from rag_train.preemption import StopSignal, agreed_rounds

logger = logging.getLogger(__name__)


def plan_shards(rows: int, shard_rows: int) -> list[tuple[int, int]]:
    """[(start, end)] of every shard, in row order."""
    return [(start, min(start + shard_rows, rows)) for start in range(0, rows, shard_rows)]


def shards_of_process(num_shards: int, rank: int, world: int) -> range:
    """The contiguous block of shard indices process `rank` of `world` encodes."""
    return range(rank * num_shards // world, (rank + 1) * num_shards // world)


def _sidecar(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard-{index:05d}.json"


def _shard_record(index: int, start: int, end: int, dim: int, dtype: str, model_fp: str, corpus_fp: str) -> dict:
    return {"file": shard_file_name(index), "start": start, "end": end, "dim": dim, "dtype": dtype,
            "model_fingerprint": model_fp, "corpus_fingerprint": corpus_fp}


def _finished(out_dir: Path, index: int, expected: dict) -> Optional[dict]:
    """The sidecar of shard `index` if its file is on disk and matches it and the planned shard, else None."""
    sidecar = _sidecar(out_dir, index)
    if not sidecar.is_file() or not (out_dir / expected["file"]).is_file():
        return None
    try:
        record = json.loads(sidecar.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    if any(record.get(key) != value for key, value in expected.items()):
        return None
    return record if sha256_file(out_dir / expected["file"]) == record.get("sha256") else None


def encode_rows(model, corpus, start: int, end: int, batch_size: int, on_batch=None, num_workers: int = 0,
                batch_tokens: int = 0) -> torch.Tensor:
    """g(y) for corpus rows [start, end), encoded in length-bucketed batches, returned in row order (fp32, CPU)."""
    return embed_rows(model, corpus, np.arange(start, end, dtype=np.int64), batch_size, torch.device("cpu"),
                      on_batch=on_batch, num_workers=num_workers, batch_tokens=batch_tokens)


def _existing_buffer(out_dir: Path, model_fp: str, corpus_fp: str, dtype: str, overwrite: bool,
                     repair: bool) -> Optional[Buffer]:
    """A complete buffer already in `out_dir` for this model + corpus; refuse to overwrite any other one
    unless `overwrite` (then None: it is rebuilt). A manifest that cannot be read is rebuilt with `repair` when the
    shards' own records say they are this model's, corpus' and dtype's (then None: intact shards are reused)."""
    path = out_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = read_manifest(path)
    except BufferError as exc:
        if overwrite:
            return None
        if repair:
            _check_sidecars(out_dir, path, {"model_fingerprint": model_fp, "corpus_fingerprint": corpus_fp,
                                            "dtype": dtype})
            logger.warning("%s: unreadable (%s); rebuilding it, shards that match their records are kept", path, exc)
            return None
        raise BufferError(f"{exc}; it is not overwritten - rerun with repair=true to rebuild it (shards that match "
                          "their records are kept), or choose another output dir") from None
    if not manifest["complete"]:
        return None
    mismatched = [key for key, value in (("model_fingerprint", model_fp), ("corpus_fingerprint", corpus_fp),
                                         ("dtype", dtype)) if manifest.get(key) != value]
    if mismatched and overwrite:
        return None
    if mismatched:
        wanted = {"model_fingerprint": model_fp, "corpus_fingerprint": corpus_fp, "dtype": dtype}
        shown = "; ".join(f"{key}: the buffer's {manifest.get(key)}, this model's {wanted[key]}" for key in mismatched)
        raise BufferError(f"{path}: field '{mismatched[0]}': {out_dir} already holds a complete buffer of another "
                          f"{', '.join(mismatched)} ({shown}); it is not overwritten - choose another output dir or "
                          "delete it")
    return Buffer.open(out_dir, model_fp, corpus_fp)


def _check_sidecars(out_dir: Path, manifest: Path, wanted: dict) -> None:
    """Before a manifest that cannot be read is rebuilt: the shard records (sidecars) must exist and all be of
    `wanted` (model, corpus, dtype), or the folder may hold another buffer, which is not overwritten."""
    sidecars = sorted(out_dir.glob("shard-*.json"))
    if not sidecars:
        raise BufferError(f"{manifest}: unreadable, and no shard records (shard-NNNNN.json) say whose shards these "
                          "are; it is not overwritten - choose another output dir or delete it")
    for sidecar in sidecars:
        try:
            record = json.loads(sidecar.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue  # an unreadable record: its shard is encoded again
        other = [key for key, value in wanted.items() if isinstance(record, dict) and record.get(key) != value]
        if other:
            raise BufferError(f"{sidecar}: field '{other[0]}': this shard is of another {', '.join(other)}; the "
                              f"buffer behind the unreadable {manifest} is not overwritten - choose another output "
                              "dir or delete it")


def _bad_shards(buffer: Buffer, rank: int, world: int, accelerator) -> list[int]:
    """Indices of the shards whose sha256 does not match the manifest; each process hashes its share."""
    mine = [i for i, shard in list(enumerate(buffer.manifest["shards"]))[rank::world]
            if sha256_file(buffer.path / shard["file"]) != shard["sha256"]]
    if accelerator is None or world == 1:
        return mine
    from accelerate.utils import gather_object

    return sorted(i for part in gather_object([mine]) for i in part)


def _remove_unplanned_shards(out_dir: Path, num_shards: int) -> None:
    """Drop shard files left by an overwritten, larger buffer (they are not in the new manifest)."""
    for path in out_dir.glob("shard-*.*"):
        stem = path.name.split(".")[0]
        if path.suffix in (".npy", ".json") and stem[6:].isdigit() and int(stem[6:]) >= num_shards:
            path.unlink()


def build_buffer(model, corpus, out_dir: Union[str, Path], batch_size: int = 256, shard_rows: int = 1_000_000,
                 dtype: str = "float16", accelerator=None, overwrite: bool = False, num_workers: int = 0,
                 batch_tokens: int = 0, passes: Optional[CorpusPasses] = None, verify: bool = False,
                 repair: bool = False, stop: Optional[StopSignal] = None) -> Buffer:
    """Embed every corpus row with `model.encode_passages` into a buffer at `out_dir`; resumes a killed build.

    `model` is a DualEncoder (or anything with `encode_passages`, `dim`, `fingerprint()`); `corpus` a
    Corpus (`len`, `passages(rows)`, `byte_lengths()`, `fingerprint`). With an accelerate `Accelerator`, each process
    encodes its own block of shards; every process returns the same opened Buffer. A complete buffer
    of another model / corpus in `out_dir` is an error unless `overwrite`. `num_workers` / `batch_tokens`:
    see `embed_rows`; `passes` records the encoding as a corpus pass (nothing when every shard is reused).
    `verify`: a complete buffer is reused only if every shard matches its sha256 (BufferError naming the first that
    does not); `repair`: instead re-encode only the shards that do not, and rebuild a manifest that cannot be read
    from the shards' records. `stop`: before each shard every process asks whether any of them got a stop signal;
    if so all stop there (Preempted), the shards they finished kept, and the same call resumes.
    """
    if dtype not in STORAGE_DTYPES:
        raise BufferError(f"dtype {dtype!r} is not one of {list(STORAGE_DTYPES)}")
    if batch_size <= 0 or shard_rows <= 0:
        raise ValueError(f"batch_size={batch_size} and shard_rows={shard_rows} must be > 0")
    rows = len(corpus)
    if rows == 0:
        raise ValueError(f"corpus {getattr(corpus, 'path', corpus)} has no passages")
    out_dir = Path(out_dir)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    is_main = rank == 0
    if accelerator is not None:
        model.to(accelerator.device)
    model_fp, corpus_fp = vectors_fingerprint(model), corpus.fingerprint
    existing = _existing_buffer(out_dir, model_fp, corpus_fp, dtype, overwrite, repair)
    bad = _bad_shards(existing, rank, world, accelerator) if existing is not None and (verify or repair) else []
    if bad and not repair:
        shard = existing.manifest["shards"][bad[0]]
        raise BufferError(f"{out_dir / MANIFEST}: field 'shards[{bad[0]}]': sha256 of {out_dir / shard['file']} does "
                          f"not match the manifest (file corrupted or replaced; {len(bad)} of "
                          f"{len(existing.manifest['shards'])} shards damaged); rerun with repair=true to re-encode "
                          "only the damaged shards")
    if bad:
        logger.warning("%s: re-encoding the %d damaged shard(s) %s", out_dir, len(bad),
                       ", ".join(existing.manifest["shards"][i]["file"] for i in bad))
        shard_rows = existing.manifest.get("shard_rows", shard_rows)  # the buffer's own layout: its shards are reused
        existing = None
    if existing is None and is_main:
        remove_stale_temporaries(out_dir)  # a killed build's temporary files: no process writes yet
    if accelerator is not None:  # nobody writes before every process has checked: they all decide alike
        accelerator.wait_for_everyone()
    if existing is not None:
        logger.info("%s already holds this buffer; nothing to encode", out_dir)
        return existing

    plan = plan_shards(rows, shard_rows)
    planned = [_shard_record(i, s, e, model.dim, dtype, model_fp, corpus_fp) for i, (s, e) in enumerate(plan)]
    with write_step("creating the buffer folder", out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        atomic_write_json(out_dir / MANIFEST, manifest_dict(rows, model.dim, dtype, [], model_fp, corpus_fp,
                                                            complete=False, shard_rows=shard_rows))
    mine = shards_of_process(len(plan), rank, world)
    todo = [i for i in mine if _finished(out_dir, i, planned[i]) is None]
    logger.info("rank %d: %d of its %d shards to encode, %d reused from an earlier run",
                rank, len(todo), len(mine), len(mine) - len(todo))
    progress = tqdm(total=sum(plan[i][1] - plan[i][0] for i in todo), unit="passage", unit_scale=True,
                    desc=f"embedding corpus (rank 0 of {world})", disable=not is_main)
    was_training = model.training
    model.eval()
    share = f" (rank 0's share of {world} processes)" if world > 1 else ""
    timed = passes.timed(f"stale buffer build{share}", progress.total) if passes and todo else contextlib.nullcontext()

    def stopped(undone: int) -> str:
        return (f"{len(plan) - undone} of {len(plan)} shards of {out_dir} are written, each with its record, and "
                f"kept; run the same command again to embed the other {undone} and finish the buffer")

    try:
        with torch.inference_mode(), timed:
            for position in agreed_rounds(len(todo), stop, accelerator, stopped):
                index = todo[position]
                start, end = plan[index]
                vectors = encode_rows(model, corpus, start, end, batch_size, on_batch=progress.update,
                                      num_workers=num_workers, batch_tokens=batch_tokens)
                stored = to_storage(vectors, dtype)
                left = sum(plan[i][1] - plan[i][0] for i in todo[position:]) * stored.itemsize * model.dim
                record = dict(planned[index], sha256=write_shard(out_dir / planned[index]["file"], stored,
                                                                 needed=left + 128 * (len(todo) - position)))
                atomic_write_json(_sidecar(out_dir, index), record)
    finally:
        model.train(was_training)
        progress.close()

    if accelerator is not None:
        accelerator.wait_for_everyone()
    if is_main:
        shards = []
        for index, expected in enumerate(planned):
            record = _finished(out_dir, index, expected)
            if record is None:
                raise BufferError(f"{_sidecar(out_dir, index)}: shard {index} missing or corrupt after the build")
            shards.append({key: record[key] for key in ("file", "start", "end", "sha256")})
        atomic_write_json(out_dir / MANIFEST, manifest_dict(
            rows, model.dim, dtype, shards, model_fp, corpus_fp, complete=True, shard_rows=shard_rows,
            passage_fingerprint=model.fingerprint("passage")))
        _remove_unplanned_shards(out_dir, len(planned))
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return Buffer.open(out_dir, model_fp, corpus_fp)

"""Which corpus a run trained on: `<run>/corpus.json` (absolute path, sha256 fingerprint, rows), written when
training opens its corpus and read back by export and evaluate, which refuse any other corpus.

Runs trained before this record existed fall back to their buffer manifest (`corpus_fingerprint`), which
every run of a buffered strategy has; a run with neither cannot be checked, and says so.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional

from rag_train.data.errors import DataError
from rag_train.io import atomic_write_json

RECORD = "corpus.json"


def record_corpus(run_dir: str | Path, corpus: Any) -> None:
    """Write the run's corpus record (main process, at the start of training)."""
    atomic_write_json(Path(run_dir) / RECORD, {"path": str(Path(corpus.path).resolve()),
                                               "fingerprint": corpus.fingerprint, "rows": len(corpus)})


def recorded_corpus(run_dir: str | Path, config: Optional[dict] = None) -> Optional[dict]:
    """{"path" (may be None), "fingerprint", "rows" (may be None), "source": file it came from} of the corpus
    the run trained on: its corpus.json, else its buffer manifest (`buffer.path` or `<run>/buffer`); None when
    the run recorded neither."""
    run_dir = Path(run_dir)
    record = run_dir / RECORD
    if record.is_file():
        found = _read(record)
        return {"path": found.get("path"), "fingerprint": found["fingerprint"], "rows": found.get("rows"),
                "source": str(record)}
    buffer_path = ((config or {}).get("buffer") or {}).get("path")
    manifest = (Path(buffer_path) if buffer_path else run_dir / "buffer") / "manifest.json"
    if manifest.is_file():
        found = _read(manifest, "corpus_fingerprint")
        return {"path": None, "fingerprint": found["corpus_fingerprint"], "rows": found.get("rows"),
                "source": str(manifest)}
    return None


def check_run_corpus(run_dir: str | Path, corpus: Any, origin: str, config: Optional[dict] = None,
                     hint: str = "") -> None:
    """Refuse `corpus` (opened from `origin`, e.g. "--corpus PATH") unless it is the corpus the run trained on;
    the error names both fingerprints. Warns when the run recorded no corpus at all."""
    recorded = recorded_corpus(run_dir, config)
    if recorded is None:
        warnings.warn(f"{run_dir}: the run recorded no corpus ({RECORD} or buffer manifest), so {corpus.path} "
                      "cannot be checked against the corpus it trained on", stacklevel=2)
        return
    if recorded["fingerprint"] != corpus.fingerprint:
        trained_on = f" ({recorded['path']}, {recorded['rows']} rows)" if recorded["path"] else ""
        raise DataError(
            f"{origin}: passages file {corpus.path} ({len(corpus)} rows, fingerprint {corpus.fingerprint[:12]}) is "
            f"not the corpus the run trained on{trained_on}: fingerprint {recorded['fingerprint'][:12]} in "
            f"{recorded['source']}{hint}")


def _read(path: Path, key: str = "fingerprint") -> dict:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(found, dict) or not isinstance(found.get(key), str):
        raise DataError(f"{path}: field '{key}': missing")
    return found

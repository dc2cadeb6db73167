"""Export a trained retriever for serving: sentence-transformers folders, a FAISS index, ONNX encoders.

Layout of an export directory (written into a temporary sibling and renamed into place, so a reader
never sees half an export):

    export.json            manifest: towers, lengths, passage format, corpus, index, onnx (read by serve)
    query/ passage/        sentence-transformers folders (or one `shared/`), each with a model card
    faiss.index            optional: inner-product index over the corpus embedded by the passage tower
    passage_ids.npy        optional: passage id of each index row (row i = corpus row i)
    passages.<ext>         optional: a copy of the corpus (`copy_corpus`); else the manifest names its path
    onnx/<tower>.onnx      optional: transformer + pooling + dense + normalize, inputs input_ids/attention_mask

The towers are read from the run's `retriever/` folder, which the training recipes write from the main
process after `accelerator.unwrap_model`; see docs/serving.md for ZeRO-3 runs.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from rag_train.buffer.embed import embed_rows
from rag_train.data.corpus import Corpus
from rag_train.data.errors import DataError
from rag_train.io import (
    CorruptFileError,
    atomic_directory,
    atomic_open,
    atomic_write_json,
    atomic_write_text,
    folder_checksums,
    read_json,
    state_bytes,
    verify_checksums,
)
from rag_train.models.retriever import META_FILE, DualEncoder
from rag_train.train.run_corpus import check_run_corpus, recorded_corpus
from rag_train.train.run_dir import RunLock

EXPORT_FORMAT_VERSION = 1
MANIFEST = "export.json"
FAISS_FILE = "faiss.index"
IDS_FILE = "passage_ids.npy"
PASSAGE_FORMAT = "title: {title} | {text}  (just {text} when the title is empty)"
# rag_train.models.retriever.format_passage for users without rag-train: written into every model card (tested equal)
PASSAGE_FORMAT_FUNCTION = '''def format_passage(title, text):
    """The text the passage tower was trained on, for a passage with this title and text."""
    title = (title or "").strip()
    return f"title: {title} | {text or ''}" if title else (text or "")'''
ONNX_OPSET = 17


class ExportError(ValueError):
    """A run directory or export directory that cannot be used, with the file and field at fault."""


def _load_run(run_dir: Path) -> tuple[dict, dict]:
    """(resolved config, metrics) of a finished run; fails before any work if its retriever is missing."""
    for required in (run_dir / "config.yaml", run_dir / "retriever" / META_FILE):
        if not required.is_file():
            raise ExportError(f"{required}: missing; {run_dir} is not a finished run directory "
                              "(train_retriever.py / train_rlm.py write it at the end of training)")
    try:
        config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    except Exception as exc:
        raise ExportError(f"{run_dir / 'config.yaml'}: not valid YAML: {exc}") from exc
    metrics_path = run_dir / "metrics.json"
    try:
        metrics = read_json(metrics_path) if metrics_path.is_file() else {}
    except CorruptFileError as exc:
        raise ExportError(str(exc)) from None
    return config, metrics


def _open_corpus(config: dict, run_dir: Path, override: Optional[str]) -> Corpus:
    """The passages file the run trained on, or `override`; refused unless its fingerprint is the one the
    run recorded (corpus.json or buffer manifest), whichever file is named and wherever export runs."""
    recorded = recorded_corpus(run_dir, config)
    data = config.get("data", {})
    if override is not None:
        path, origin = Path(override), "--corpus"
    elif recorded is not None and recorded["path"]:
        path, origin = Path(recorded["path"]), f"{recorded['source']}: field 'path'"
    elif data.get("passages"):
        path, origin = Path(data["passages"]), f"{run_dir / 'config.yaml'}: field 'data.passages'"
    elif data.get("toy"):
        from rag_train.data.toy_files import toy_paths

        path = toy_paths(Path(data["toy_dir"]))["passages"]
        origin = f"{run_dir / 'config.yaml'}: field 'data.toy_dir'"
    else:
        raise ExportError(f"{run_dir / 'config.yaml'}: field 'data.passages' is empty; pass --corpus")
    if not path.exists():  # a file, or a datasets.save_to_disk folder
        raise ExportError(f"{origin}: passages file {path} does not exist (pass --corpus PATH)")
    corpus = Corpus.open(path)
    try:
        check_run_corpus(run_dir, corpus, origin, config, hint="; pass --corpus with the file the run trained "
                         "on (only a file with that fingerprint is accepted)")
    except DataError as exc:
        corpus.close()
        raise ExportError(str(exc)) from None
    return corpus


def _summary(config: dict, metrics: dict) -> tuple[dict, dict]:
    """The config keys and headline metrics a model card shows (no per-step history)."""
    train, data = config.get("train", {}), config.get("data", {})
    keys = {"strategy": config.get("strategy", {}).get("name"),
            **{f"train.{k}": train.get(k) for k in ("steps", "batch_size", "lr", "temperature", "seed")},
            **{f"retriever.{k}": v for k, v in config.get("retriever", {}).items() if not isinstance(v, dict)},
            "data": data.get("passages") or ("toy world" if data.get("toy") else None)}
    headline = {}
    for name, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            headline[name] = value
        elif isinstance(value, dict) and value and all(isinstance(v, (int, float))
                                                       for v in value.values() if v is not None):
            headline.update({f"{name}@{k}" if not name.endswith(str(k)) else name: v for k, v in value.items()})
    return keys, headline


def _model_card(role: str, folder: str, meta: dict, keys: dict, headline: dict) -> str:
    encodes = {"query": "questions", "passage": "passages", "shared": "questions and passages"}[role]
    rows = "\n".join(f"| {k} | {v} |" for k, v in keys.items())
    scores = "\n".join(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in headline.items())
    return f"""---
library_name: sentence-transformers
pipeline_tag: sentence-similarity
tags: [sentence-transformers, feature-extraction, dense-retrieval, rag-train]
---

# rag-train retriever: {role} encoder

Dense retriever trained with rag-train; this folder encodes **{encodes}**. Relevance is the inner
product of the (L2-normalised) query and passage vectors. Dimension: {meta['dim']}.

```python
from sentence_transformers import SentenceTransformer
model = SentenceTransformer("path/to/export/{folder}")
vectors = model.encode(["..."])
```

- Queries were truncated to {meta['max_query_length']} tokens in training, passages to {meta['max_passage_length']}.
- Passages are encoded as `{PASSAGE_FORMAT}`; format yours the same way before encoding them:

```python
{PASSAGE_FORMAT_FUNCTION}
```
- Weights fingerprint (sha256 of the whole dual encoder): `{meta['fingerprint']}`.

## Training configuration

| key | value |
|---|---|
{rows}

## Metrics (from the run's metrics.json)

| metric | value |
|---|---|
{scores if scores else '| (none recorded) | |'}
"""


def _write_towers(model: DualEncoder, out: Path, meta: dict, keys: dict, headline: dict) -> dict[str, str]:
    """One sentence-transformers folder per tower; returns {"query": folder, "passage": folder}."""
    if model.shared_towers:
        towers = {"shared": model.query_encoder}
        # one tokenizer limit per folder: the passage one; the server truncates queries itself
        model.query_encoder.max_seq_length = model.max_passage_length
    else:
        towers = {"query": model.query_encoder, "passage": model.passage_encoder}
    for name, tower in towers.items():
        tower.save(str(out / name))
        atomic_write_text(out / name / "README.md", _model_card(name, name, meta, keys, headline))
    shared = "shared" if model.shared_towers else None
    return {"query": shared or "query", "passage": shared or "passage"}


def _embed_into_index(model: DualEncoder, corpus: Corpus, factory: str, batch_size: int, device: torch.device,
                      train_rows: int = 262144, chunk_rows: int = 65536, num_workers: int = 1):
    """Inner-product FAISS index over every corpus row (in row order), embedded chunk by chunk."""
    import faiss

    index = faiss.index_factory(model.dim, factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        sample = np.linspace(0, len(corpus) - 1, num=min(len(corpus), train_rows)).astype(np.int64)
        index.train(embed_rows(model, corpus, sample, batch_size, torch.device("cpu"), progress=True,
                               num_workers=num_workers).numpy())
    bar = tqdm(total=len(corpus), desc="index", unit="psg")
    for start in range(0, len(corpus), chunk_rows):
        rows = np.arange(start, min(start + chunk_rows, len(corpus)))
        vectors = embed_rows(model, corpus, rows, batch_size, torch.device("cpu"), num_workers=num_workers)
        index.add(np.ascontiguousarray(vectors.numpy()))
        bar.update(len(rows))
    bar.close()
    return index


def _check_factory(factory: str, dim: int, rows: int) -> None:
    import faiss

    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ExportError(f"--faiss {factory!r}: not a FAISS index factory string: {exc}") from exc
    lists = getattr(faiss.try_extract_index_ivf(index), "nlist", 0) if "IVF" in factory else 0
    if lists > rows:
        raise ExportError(f"--faiss {factory!r}: {lists} inverted lists for a corpus of {rows} passages; use fewer")


class _OnnxTower(torch.nn.Module):
    """(input_ids, attention_mask) -> sentence_embedding through the whole tower, for torch.onnx.export."""

    def __init__(self, tower):
        super().__init__()
        self.tower = tower

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.tower({"input_ids": input_ids, "attention_mask": attention_mask})["sentence_embedding"]


def _export_onnx(model: DualEncoder, folders: dict[str, str], out: Path) -> dict[str, dict]:
    """TorchScript-based ONNX export of each tower (dynamic batch and length); tokenisation stays outside."""
    towers = {"shared": model.query_encoder} if model.shared_towers else {
        "query": model.query_encoder, "passage": model.passage_encoder}
    (out / "onnx").mkdir()
    result = {}
    for name, tower in towers.items():
        tower.eval()
        example = tower.preprocess(["an example input", "a second, longer example input text"], max_length=16)
        path = out / "onnx" / f"{name}.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer notes on shape checks that hold for every input here
            torch.onnx.export(_OnnxTower(tower), (example["input_ids"], example["attention_mask"]), str(path),
                              input_names=["input_ids", "attention_mask"], output_names=["sentence_embedding"],
                              dynamic_axes={"input_ids": {0: "batch", 1: "length"},
                                            "attention_mask": {0: "batch", 1: "length"},
                                            "sentence_embedding": {0: "batch"}},
                              opset_version=ONNX_OPSET, dynamo=False)
        result[name] = {"file": f"onnx/{name}.onnx", "tokenizer": name, "opset": ONNX_OPSET}
    return {role: result[folder] for role, folder in folders.items()}


def _export_bytes(model: DualEncoder, corpus: Optional[Corpus], faiss: bool, onnx: bool, copy_corpus: bool) -> int:
    """About what an export takes on disk (towers, ONNX copies, a flat index and ids, the copied corpus): the space
    a full disk is reported against."""
    towers = state_bytes(model.query_encoder, None if model.shared_towers else model.passage_encoder)
    size = towers * (2 if onnx else 1) + 2**20
    if corpus is not None and faiss:
        size += len(corpus) * (model.dim * 4 + 64)
    if corpus is not None and copy_corpus:
        size += Path(corpus.path).stat().st_size
    return size


def export_retriever(run_dir: str | Path, out_dir: str | Path, faiss_factory: Optional[str] = None,
                     onnx: bool = False, corpus: Optional[str] = None, copy_corpus: bool = False,
                     nprobe: int = 32, batch_size: int = 256, overwrite: bool = False) -> dict:
    """Export the run's retriever to `out_dir`; returns the manifest (also written as export.json)."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    with RunLock(out_dir, "export", beside=True):  # one writer per export folder
        return _export(run_dir, out_dir, faiss_factory, onnx, corpus, copy_corpus, nprobe, batch_size, overwrite)


def _export(run_dir: Path, out_dir: Path, faiss_factory: Optional[str], onnx: bool, corpus: Optional[str],
            copy_corpus: bool, nprobe: int, batch_size: int, overwrite: bool) -> dict:
    config, metrics = _load_run(run_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (overwrite and (out_dir / MANIFEST).is_file()):
        raise ExportError(f"{out_dir}: exists and is not empty" + ("" if overwrite else "; pass --overwrite to "
                          "replace a previous export") + (" (and holds no export.json: refusing to replace it)"
                                                           if overwrite else ""))
    corpus_store = None
    if faiss_factory is not None or copy_corpus:
        corpus_store = _open_corpus(config, run_dir, corpus)
    model = DualEncoder.load(run_dir / "retriever")
    if faiss_factory is not None:
        _check_factory(faiss_factory, model.dim, len(corpus_store))
    meta = {"dim": model.dim, "max_query_length": model.max_query_length,
            "max_passage_length": model.max_passage_length, "fingerprint": model.fingerprint()}
    keys, headline = _summary(config, metrics)
    needed = _export_bytes(model, corpus_store, faiss_factory is not None, onnx, copy_corpus)

    with atomic_directory(out_dir, "writing the export", needed=needed) as tmp:
        folders = _write_towers(model, tmp, meta, keys, headline)
        manifest = {"format_version": EXPORT_FORMAT_VERSION, "source_run": str(run_dir.resolve()),
                    "shared_towers": model.shared_towers, "towers": folders, "passage_format": PASSAGE_FORMAT,
                    "passage_format_python": PASSAGE_FORMAT_FUNCTION,
                    "metrics": headline, **meta}
        if corpus_store is not None:
            source = Path(corpus_store.path)
            entry = {"fingerprint": corpus_store.fingerprint, "rows": len(corpus_store), "path": str(source.resolve())}
            if copy_corpus:
                entry["path"] = f"passages{source.suffix}"
                shutil.copyfile(source, tmp / entry["path"])
            manifest["corpus"] = entry
        if faiss_factory is not None:
            import faiss

            workers = (config.get("buffer") or {}).get("embed_workers", 1)  # the run's own setting
            index = _embed_into_index(model, corpus_store, faiss_factory, batch_size, torch.device("cpu"),
                                      num_workers=workers)
            with atomic_open(tmp / FAISS_FILE) as handle:
                handle.write(faiss.serialize_index(index).tobytes())
            ids = np.array([corpus_store.id(row) for row in range(len(corpus_store))], dtype=np.str_)
            with atomic_open(tmp / IDS_FILE) as handle:
                np.save(handle, ids, allow_pickle=False)
            manifest["faiss"] = {"file": FAISS_FILE, "factory": faiss_factory, "rows": int(index.ntotal),
                                 "ids": IDS_FILE, "nprobe": nprobe}
        if onnx:
            manifest["onnx"] = _export_onnx(model, folders, tmp)
        manifest["files"] = folder_checksums(tmp)  # sha256 + size of every file, checked when it is served
        atomic_write_json(tmp / MANIFEST, manifest)
    return manifest


def load_manifest(export_dir: str | Path, verify: bool = True) -> dict:
    """The manifest of an export, checked for the version this code reads; with `verify`, every file of the
    export is checked against the manifest's sha256 and size (ExportError naming a truncated / altered file)."""
    path = Path(export_dir) / MANIFEST
    if not path.is_file():
        raise ExportError(f"{path}: missing; {export_dir} is not an export (run scripts/export_retriever.py)")
    try:
        manifest = read_json(path)
        if manifest.get("format_version") != EXPORT_FORMAT_VERSION:
            raise ExportError(f"{path}: field 'format_version': {manifest.get('format_version')!r} is not "
                              f"{EXPORT_FORMAT_VERSION}, the version this code reads")
        if verify and "files" in manifest:
            verify_checksums(Path(export_dir), manifest["files"], path)
    except CorruptFileError as exc:
        raise ExportError(str(exc)) from None
    return manifest

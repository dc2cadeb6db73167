"""A run records the corpus it trained on (absolute paths + fingerprint); export and evaluate refuse any other,
from whatever directory they run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rag_train.buffer.store import Buffer
from rag_train.config import DataConfig, save_config
from rag_train.data.corpus import Corpus
from rag_train.data.toy_files import toy_paths
from rag_train.serving.export import ExportError, export_retriever
from rag_train.train.retriever import train_retriever
from rag_train.train.schema import RLMConfig

from test_export import make_run
from test_train_retriever import config

ROOT = Path(__file__).resolve().parents[1]


def other_world(destination: Path, toy_dir: Path) -> Corpus:
    """A copy of the toy world whose first passage differs by one letter: same rows and file sizes (so the toy
    world still looks current), another fingerprint."""
    shutil.copytree(toy_dir, destination, ignore=shutil.ignore_patterns(".lock", ".*cache*"))
    passages = toy_paths(destination)["passages"]
    raw = passages.read_bytes()
    at = raw.index(b'"text": "') + len(b'"text": "')
    passages.write_bytes(raw[:at] + raw[at:at + 1].swapcase() + raw[at + 1:])
    return Corpus.open(passages)


@pytest.mark.slow
def test_export_from_another_directory_uses_the_corpus_the_run_trained_on(recipe_toy_dir, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "toy").symlink_to(recipe_toy_dir)
    monkeypatch.chdir(home)
    train_retriever(config(Path("toy"), Path("run"), "in_batch", steps=1))  # relative data path, as users type it
    run = home / "run"
    trained_on = Corpus.open(toy_paths(recipe_toy_dir)["passages"])
    assert OmegaConf.load(run / "config.yaml").data.toy_dir == str(recipe_toy_dir.resolve())
    assert json.loads((run / "corpus.json").read_text()) == {
        "path": str(toy_paths(recipe_toy_dir)["passages"].resolve()), "fingerprint": trained_on.fingerprint,
        "rows": len(trained_on)}

    elsewhere = tmp_path / "elsewhere"
    other = other_world(elsewhere / "toy", recipe_toy_dir)  # another toy world at the same relative path
    assert other.fingerprint != trained_on.fingerprint and len(other) == len(trained_on)
    monkeypatch.chdir(elsewhere)
    manifest = export_retriever(run, "export", faiss_factory="Flat")
    assert manifest["corpus"]["fingerprint"] == trained_on.fingerprint and manifest["faiss"]["rows"] == 300
    # --corpus overrides only with the same content: another file is refused, naming both fingerprints
    with pytest.raises(ExportError, match=rf"--corpus: .*fingerprint {other.fingerprint[:12]}\).*"
                                          rf"fingerprint {trained_on.fingerprint[:12]} in .*corpus.json"):
        export_retriever(run, "refused", faiss_factory="Flat", corpus="toy/passages.jsonl")
    assert not Path("refused").exists()
    shutil.copyfile(trained_on.path, "copy.jsonl")
    copied = export_retriever(run, "copied", faiss_factory="Flat", corpus="copy.jsonl")
    assert copied["corpus"]["path"] == str((elsewhere / "copy.jsonl").resolve())


def test_runs_without_a_corpus_record_are_checked_against_their_buffer_manifest(recipe_toy_dir, tmp_path,
                                                                                monkeypatch):
    """A run saved before corpus.json existed: relative `data.toy_dir` in config.yaml and a buffer whose manifest
    holds the corpus fingerprint. Run from a directory holding another toy world, export used to index that
    world silently (exit 0, the wrong rows); now it refuses, naming both fingerprints."""
    run, model = make_run(tmp_path / "run", recipe_toy_dir)
    (run / "corpus.json").unlink()
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace(str(recipe_toy_dir.resolve()), "toy"))
    trained_on = Corpus.open(toy_paths(recipe_toy_dir)["passages"])
    Buffer.write(run / "buffer", [[0.0] * model.dim] * len(trained_on), model_fingerprint=model.fingerprint(),
                 corpus_fingerprint=trained_on.fingerprint)
    other = other_world(tmp_path / "elsewhere" / "toy", recipe_toy_dir)
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(ExportError, match=rf"data.toy_dir': passages file .*fingerprint {other.fingerprint[:12]}\)"
                                          rf".*fingerprint {trained_on.fingerprint[:12]} in .*buffer/manifest.json"):
        export_retriever(run, "export", faiss_factory="Flat")
    manifest = export_retriever(run, "export", faiss_factory="Flat", corpus=str(trained_on.path))
    assert manifest["corpus"]["fingerprint"] == trained_on.fingerprint


@pytest.mark.slow
def test_evaluate_refuses_a_corpus_the_run_did_not_train_on(recipe_toy_dir, tmp_path):
    other = other_world(tmp_path / "other", recipe_toy_dir)
    files = toy_paths(recipe_toy_dir)
    run = tmp_path / "run"
    for part in ("retriever", "reader"):
        (run / part).mkdir(parents=True)
    cfg = RLMConfig(data=DataConfig(toy=False, passages=str(other.path), train=str(files["nq-train"]),
                                    dev=[str(files["nq-dev"])]))
    save_config(cfg, run / "config.yaml")
    trained_on = Corpus.open(files["passages"])
    (run / "corpus.json").write_text(json.dumps({"path": str(trained_on.path), "fingerprint": trained_on.fingerprint,
                                                 "rows": len(trained_on)}))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), "--run", str(run)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2, result.stderr[-2000:]  # bad input (docs/reliability.md), one `error:` line
    assert "Traceback" not in result.stderr and result.stderr.count("error: ") == 1
    assert f"fingerprint {other.fingerprint[:12]}" in result.stderr
    assert f"fingerprint {trained_on.fingerprint[:12]} in {run / 'corpus.json'}" in result.stderr


def test_the_server_refuses_a_corpus_changed_after_export(recipe_toy_dir, tmp_path):
    """The last link of run -> export -> serve: the export records the fingerprint export checked against the
    run, and the server refuses to start on a referenced corpus whose content changed since."""
    from rag_train.serving.serve import ExportedRetriever

    toy = tmp_path / "toy"
    shutil.copytree(recipe_toy_dir, toy, ignore=shutil.ignore_patterns(".lock", "*.index"))
    run, _ = make_run(tmp_path / "run", toy)
    manifest = export_retriever(run, tmp_path / "export", faiss_factory="Flat")
    exported_from = manifest["corpus"]["fingerprint"]
    ExportedRetriever(tmp_path / "export").corpus.close()  # starts on the corpus it was built from
    changed = other_world(tmp_path / "changed", toy)
    shutil.copyfile(changed.path, toy_paths(toy)["passages"])
    with pytest.raises(ExportError, match=rf"content differs .* \(fingerprint {changed.fingerprint[:12]} != "
                                          rf"{exported_from[:12]}\)"):
        ExportedRetriever(tmp_path / "export")

"""Export: standalone sentence-transformers folders, ONNX and a Flat FAISS index match the trained model."""

import json
import site
import subprocess
import sys

import numpy as np
import pytest
import torch

from rag_train.buffer.embed import embed_rows
from rag_train.buffer.search import search
from rag_train.config import DataConfig, RetrieverConfig, TinyModelConfig, save_config
from rag_train.data.corpus import Corpus
from rag_train.data.toy_files import toy_paths
from rag_train.models.retriever import DualEncoder
from rag_train.serving.export import ExportError, export_retriever, load_manifest
from rag_train.train.run_corpus import record_corpus
from rag_train.train.schema import RetrieverTrainConfig

QUESTIONS = ["Who trained Bihe Ziturin?", "Which instrument does the tallest person play?", "x"]
_CACHE: dict = {}


def make_run(root, toy_dir, shared_towers=False):
    """A finished run directory as the recipes leave it: config.yaml, metrics.json, corpus.json, retriever/.

    The passage tower is perturbed so the two towers differ and a swapped export cannot pass.
    """
    cfg = RetrieverTrainConfig(
        data=DataConfig(toy_dir=str(toy_dir), toy_passages=300),
        retriever=RetrieverConfig(projection_dim=24, shared_towers=shared_towers, max_passage_length=48,
                                  tiny=TinyModelConfig(d_model=32, d_ff=64, num_heads=2, num_layers=2)))
    model = DualEncoder.from_config(cfg.retriever, tokenizer=toy_paths(toy_dir)["tokenizer"])
    if not shared_towers:
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            for param in model.passage_encoder.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    root.mkdir(parents=True)
    save_config(cfg, root / "config.yaml")
    (root / "metrics.json").write_text(json.dumps({"recall": {"5": 0.5, "20": 0.75}, "mrr@10": 0.25, "steps": 7}))
    model.save(root / "retriever")
    record_corpus(root, Corpus.open(toy_paths(toy_dir)["passages"]))
    return root, model


def exported(tmp_path_factory, toy_dir, **kwargs):
    """(export dir, trained model, manifest), built once per option set for the whole session."""
    key = tuple(sorted(kwargs.items()))
    if key not in _CACHE:
        root = tmp_path_factory.mktemp("export")
        run, model = make_run(root / "run", toy_dir)
        manifest = export_retriever(run, root / "export", **kwargs)
        _CACHE[key] = root / "export", model, manifest
    return _CACHE[key]


@pytest.fixture(scope="module")
def full_export(tmp_path_factory, recipe_toy_dir):
    return exported(tmp_path_factory, recipe_toy_dir, faiss_factory="Flat", onnx=True, copy_corpus=True)


def _isolated_python(script: str, cwd, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `script` where rag_train is not importable: no site hooks (the editable install is a .pth
    finder), no cwd / PYTHONPATH on sys.path; only the site-packages folders themselves."""
    bootstrap = f"import sys; sys.path.extend({site.getsitepackages()!r})\n"
    return subprocess.run([sys.executable, "-I", "-S", "-c", bootstrap + script], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_sentence_transformers_folders_load_without_the_package(full_export, tmp_path):
    export_dir, model, manifest = full_export
    assert manifest["towers"] == {"query": "query", "passage": "passage"}
    passages = [{"title": "Bihe Ziturin", "text": "Bihe Ziturin was trained by Migor Nevekar."},
                {"title": "", "text": "A passage without a title that is longer than the others are."}]
    texts = {"query": QUESTIONS, "passage": [p["title"] and f"title: {p['title']} | {p['text']}" or p["text"]
                                             for p in passages]}
    script = f"""
import json, sys
try:
    import rag_train
    sys.exit("rag_train is importable here")
except ModuleNotFoundError:
    pass
from sentence_transformers import SentenceTransformer
texts = {json.dumps(texts)}
out = {{}}
for tower in ("query", "passage"):
    model = SentenceTransformer({str(export_dir)!r} + "/" + tower, device="cpu")
    out[tower] = model.encode(texts[tower], convert_to_numpy=True).tolist()
print(json.dumps(out))
"""
    result = _isolated_python(script, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    standalone = json.loads(result.stdout.strip().splitlines()[-1])
    model.eval()
    with torch.no_grad():
        trained = {"query": model.encode_queries(QUESTIONS), "passage": model.encode_passages(passages)}
    for tower in ("query", "passage"):
        got = torch.tensor(standalone[tower])
        cosine = torch.nn.functional.cosine_similarity(got, trained[tower], dim=-1)
        assert cosine.min() > 0.9999, (tower, cosine)
    # the towers really differ, so a swap would have been caught
    with torch.no_grad():
        assert (model.encode_queries(texts["passage"]) - trained["passage"]).abs().max() > 1e-3
    card = (export_dir / "query" / "README.md").read_text()
    assert "| mrr@10 | 0.25 |" in card and "| recall@20 | 0.75 |" in card and "| train.steps |" in card


def test_onnx_matches_pytorch(full_export):
    import onnxruntime

    export_dir, model, manifest = full_export
    model.eval()
    for role, texts, length in (("query", QUESTIONS, model.max_query_length),
                                ("passage", ["title: A | " + "word " * 80, "short"], model.max_passage_length)):
        tower = getattr(model, f"{role}_encoder")
        features = tower.preprocess(texts, max_length=length)
        session = onnxruntime.InferenceSession(str(export_dir / manifest["onnx"][role]["file"]))
        (onnx_out,) = session.run(None, {"input_ids": features["input_ids"].numpy(),
                                         "attention_mask": features["attention_mask"].numpy()})
        with torch.no_grad():
            reference = model._encode(tower, texts, length).numpy()
        assert onnx_out.shape == reference.shape
        np.testing.assert_allclose(onnx_out, reference, atol=1e-4)


def test_flat_faiss_matches_exact_search(full_export):
    import faiss

    export_dir, model, manifest = full_export
    corpus = Corpus.open(export_dir / manifest["corpus"]["path"])  # the export's own copy
    assert manifest["corpus"]["fingerprint"] == corpus.fingerprint and manifest["faiss"]["rows"] == len(corpus)
    ids = np.load(export_dir / manifest["faiss"]["ids"])
    assert ids.dtype.kind == "U" and ids.tolist() == [corpus.id(r) for r in range(len(corpus))]  # str, not bytes
    buffer = embed_rows(model, corpus, np.arange(len(corpus)), 64, torch.device("cpu"))
    with torch.no_grad():
        queries = model.encode_queries(QUESTIONS)
    exact = search(queries, buffer, k=10, mode="exact")
    index = faiss.read_index(str(export_dir / manifest["faiss"]["file"]))
    scores, rows = index.search(queries.numpy(), 10)
    assert (torch.from_numpy(rows) == exact.rows).all()
    np.testing.assert_allclose(scores, exact.scores.numpy(), atol=1e-5)


def test_shared_towers_export_one_folder(tmp_path, recipe_toy_dir):
    run, model = make_run(tmp_path / "run", recipe_toy_dir, shared_towers=True)
    manifest = export_retriever(run, tmp_path / "export", faiss_factory="Flat")
    assert manifest["towers"] == {"query": "shared", "passage": "shared"}
    assert manifest["corpus"]["path"] == str(toy_paths(recipe_toy_dir)["passages"].resolve())  # referenced
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [
        "export.json", "faiss.index", "passage_ids.npy", "shared"]
    assert load_manifest(tmp_path / "export")["fingerprint"] == model.fingerprint()


def test_bad_inputs_fail_before_work(tmp_path, recipe_toy_dir):
    with pytest.raises(ExportError, match=r"config.yaml: missing"):
        export_retriever(tmp_path, tmp_path / "out")
    run, _ = make_run(tmp_path / "run", recipe_toy_dir)
    with pytest.raises(ExportError, match="not a FAISS index factory string"):
        export_retriever(run, tmp_path / "out", faiss_factory="NotAnIndex")
    with pytest.raises(ExportError, match="1024 inverted lists for a corpus of 300"):
        export_retriever(run, tmp_path / "out", faiss_factory="IVF1024,Flat")
    with pytest.raises(ExportError, match=r"--corpus: passages file .* does not exist"):
        export_retriever(run, tmp_path / "out", faiss_factory="Flat", corpus=str(tmp_path / "none.jsonl"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("user data")
    with pytest.raises(ExportError, match="holds no export.json"):
        export_retriever(run, tmp_path / "taken", overwrite=True)
    assert not (tmp_path / "out").exists() and (tmp_path / "taken" / "keep.txt").read_text() == "user data"


def test_loaded_retrievers_are_in_eval_mode(tmp_path, recipe_toy_dir):
    run, _ = make_run(tmp_path / "run", recipe_toy_dir)
    loaded = DualEncoder.load(run / "retriever")
    assert not any(module.training for module in loaded.modules())  # no dropout without an explicit .train()
    with torch.no_grad():
        first, second = loaded.encode_passages(QUESTIONS), loaded.encode_passages(QUESTIONS)
    assert torch.equal(first, second)


def test_model_cards_carry_the_passage_format_as_a_function(full_export):
    """The card's (package-free) format_passage is the function the towers were trained with."""
    from rag_train.models.retriever import format_passage

    export_dir, _, manifest = full_export
    card = (export_dir / "passage" / "README.md").read_text()
    code = card.split("```python\n")[2].split("```")[0]
    assert code.startswith("def format_passage(") and code.strip() == manifest["passage_format_python"]
    namespace: dict = {}
    exec(code, namespace)
    for title, text in (("Bihe Ziturin", "was trained by Migor."), ("", "no title"), ("  padded  ", "x | y"),
                        (None, "none"), ("   ", "blank title"), ("T", "")):
        assert namespace["format_passage"](title, text) == format_passage({"title": title, "text": text})

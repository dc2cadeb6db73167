"""Layers import downwards only (docs/architecture.md): every `rag_train` import in the package, including the ones
inside functions, goes to the same layer or a lower one; and config + data, used for real (a toy world generated),
load nothing of the models, buffer, strategies, recipes or command line."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rag_train"

# lowest first; a module not listed is above them all (it may import anything, nothing listed may import it)
LAYERS = [
    ("rag_train.io", "rag_train.losses", "rag_train.launch"),
    ("rag_train.config",),
    ("rag_train.data",),
    ("rag_train.models",),
    ("rag_train.buffer", "rag_train.run_corpus"),
    ("rag_train.strategies", "rag_train.eval", "rag_train.synthetic", "rag_train.generative"),
    ("rag_train.train", "rag_train.embed_corpus", "rag_train.export", "rag_train.experiments"),
    ("rag_train.serve", "rag_train.reproduction", "rag_train.generative.compare", "rag_train.eval.diagnose_rlm",
     "rag_train.eval.diagnose_retriever"),
    ("rag_train.cli", "rag_train.bench"),  # benchmarks time the code users run, entry points (cli) included
]


def layer(module: str) -> int:
    if module == "rag_train":  # the package's own __init__ (a version string)
        return 0
    matches = [(len(p), rank) for rank, prefixes in enumerate(LAYERS) for p in prefixes
               if module == p or module.startswith(p + ".")]
    return max(matches)[1] if matches else len(LAYERS)  # the most specific entry decides


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name == "rag_train" or name.startswith("rag_train.")]


def test_every_import_goes_down():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for line, target in imports(path):
            if layer(target) > layer(module):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({module}, layer {layer(module)}) imports {target} "
                             f"(layer {layer(target)})")
    assert not wrong, "\n".join(wrong)


def test_config_and_data_load_nothing_above_them(tmp_path):
    code = f"""
import json, sys
from rag_train.config import DataConfig, load_config
from rag_train.data.sources import resolve_data
from rag_train.data.toy import ensure_toy_world
from rag_train.data.corpus import Corpus
from rag_train.data.qa import load_qa
from rag_train.data.supervised import load_retrieval
from rag_train.data.tokenizer import load_tokenizer
from rag_train.data.collate import fid_inputs

files = ensure_toy_world(DataConfig(toy_dir={str(tmp_path)!r}, toy_passages=120))
corpus = Corpus.open(files["passages"])
questions = load_qa(files["nq-dev"], corpus=corpus)
tokenizer = load_tokenizer(files["tokenizer"])
fid_inputs(tokenizer, [q.question for q in questions[:2]], [corpus.passages([0, 1])] * 2, 32)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("rag_train"))))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "rag_train.data.toy" in loaded and "rag_train.data.tokenizer" in loaded  # the imports did run
    above = [m for m in loaded if layer(m) > layer("rag_train.data")]
    assert not above, above

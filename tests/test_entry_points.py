"""One entry-point convention (docs/architecture.md): every script in scripts/ is a docstring, imports (and
constants such as its default config file, and the set-up that must precede torch: `BEFORE_TORCH`) and one call
into the package under `if __name__ == "__main__":`, made inside `rag_train.cli.exit_on_fault` (directly, or through
`run_recipe`, which enters it), so every script ends a known fault with one `error:` line and the exit statuses of
docs/reliability.md. Checked on the scripts' syntax trees, and through two scripts whose faults used to end
otherwise."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
# scripts whose package call enters exit_on_fault itself, and why it cannot be entered here
OWN_FAULT_HANDLING = {
    "gpu_report.py": "runs on a bare GPU machine: it installs the wheels that rag_train.cli needs (omegaconf) "
                     "before importing it, then enters exit_on_fault in rag_lab.bench.gpu_report.cli.run_stages",
}


# process setup a script may call between its imports, because it must run before torch loads (so not in main):
# the reproduction's pinned CPU kernels (rag_lab/reproduction/kernels.py)
BEFORE_TORCH = {"pin_cpu_kernels"}


def is_call(node: ast.AST, name: str | None = None) -> bool:
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    func = node.value.func
    return name is None or (isinstance(func, ast.Name) and func.id == name)


def convention_problems(path: Path) -> list[str]:
    body = ast.parse(path.read_text(), str(path)).body
    problems = []
    if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        problems.append("no docstring saying what it runs")
    *top, last = body[1:] if body else [None]
    for node in top:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            continue  # a constant: the recipe's default config file
        if path.name in OWN_FAULT_HANDLING and isinstance(node, ast.If):  # its sys.path line for a bare machine
            continue
        if any(is_call(node, name) for name in BEFORE_TORCH):
            continue
        problems.append(f"line {node.lineno}: {type(node).__name__} at the top level (only imports: the work "
                        "belongs in a package function)")
    main_block = (isinstance(last, ast.If) and isinstance(last.test, ast.Compare)
                  and isinstance(last.test.left, ast.Name) and last.test.left.id == "__name__")
    if not main_block:
        return problems + ['it does not end with `if __name__ == "__main__":`']
    if len(last.body) != 1:
        return problems + ["its main block is not one statement"]
    (stmt,) = last.body
    if path.name in OWN_FAULT_HANDLING or is_call(stmt, "run_recipe"):
        return problems if is_call(stmt) else problems + ["its main block is not one call"]
    wrapped = (isinstance(stmt, ast.With) and len(stmt.items) == 1
               and isinstance(stmt.items[0].context_expr, ast.Call)
               and getattr(stmt.items[0].context_expr.func, "id", None) == "exit_on_fault")
    if not wrapped:
        return problems + ["its call is not made inside `with exit_on_fault():` (nor through run_recipe)"]
    if len(stmt.body) != 1 or not is_call(stmt.body[0]):
        problems.append("its `with exit_on_fault():` holds more than one call")
    return problems


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_the_script_is_one_call_inside_exit_on_fault(path):
    assert not convention_problems(path), convention_problems(path)


def test_the_checker_refuses_what_the_convention_forbids(tmp_path):
    cases = {
        "logic.py": '"""x"""\nimport sys\nx = 1\n'
                    'if __name__ == "__main__":\n    with exit_on_fault():\n        main()\n',
        "bare.py": '"""x"""\nfrom m import main\nif __name__ == "__main__":\n    main()\n',
        "two.py": '"""x"""\nif __name__ == "__main__":\n    with exit_on_fault():\n        a()\n        b()\n',
        "good.py": '"""x"""\nfrom m import main\n'
                   'if __name__ == "__main__":\n    with exit_on_fault():\n        main()\n',
        "recipe.py": '"""x"""\nif __name__ == "__main__":\n    run_recipe(A, B, c, d)\n',
        "pinned.py": '"""x"""\nimport os\npin_cpu_kernels(os.environ)\nfrom m import main\n'
                     'if __name__ == "__main__":\n    with exit_on_fault():\n        main()\n',
        "setup.py": '"""x"""\nimport os\nsetup(os.environ)\nfrom m import main\n'
                    'if __name__ == "__main__":\n    with exit_on_fault():\n        main()\n',
    }
    found = {}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        found[name] = convention_problems(tmp_path / name)
    assert found == {
        "logic.py": ["line 3: Assign at the top level (only imports: the work belongs in a package function)"],
        "bare.py": ["its call is not made inside `with exit_on_fault():` (nor through run_recipe)"],
        "two.py": ["its `with exit_on_fault():` holds more than one call"],
        "good.py": [], "recipe.py": [], "pinned.py": [],
        "setup.py": ["line 3: Expr at the top level (only imports: the work belongs in a package function)"]}


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_evaluate_on_a_folder_that_is_no_run_is_bad_input_in_one_line(tmp_path):
    proc = run_script(ROOT / "scripts" / "evaluate.py", "--run", tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]  # was 1, from its own sys.exit
    assert proc.stderr.strip() == (f"error: {tmp_path} is not a finished RLM run: missing config.yaml, retriever, "
                                   "reader")


def test_make_toy_data_with_a_bad_size_is_bad_input_in_one_line(tmp_path):
    """...and is told before torch or transformers load: exit_on_fault catches the error classes of the modules the
    script loaded, without loading the others (the reader's loads transformers' T5, seconds of CPU)."""
    loaded = "import atexit, sys; atexit.register(lambda: print('loaded', [m for m in ('torch', 'transformers') " \
             "if m in sys.modules], file=sys.stderr)); import runpy; sys.argv = sys.argv[1:]; " \
             "runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = run_script("-c", loaded, ROOT / "scripts" / "make_toy_data.py", "--out", tmp_path / "toy", "--passages", "3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("loaded []")
    assert not (tmp_path / "toy" / "manifest.json").exists()

"""Code says why, not when: no line of the library, the lab or the scripts cites a date or an issue number (they
age, and the history of a change belongs in docs/ and the commit log); a `#53` reference in a comment or a
docstring counts too."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = [ROOT / "rag_train", ROOT / "rag_lab", ROOT / "scripts"]
DATE = r"\b20\d\d-\d\d-\d\d\b"
ISSUE = r"\b[Ii]ssues? #?\d+"
ANYWHERE = re.compile(f"{DATE}|{ISSUE}")  # also in strings: the brief's grep
IN_PROSE = re.compile(r"(?:^|[\s(\[])#\d+\b|\bPR ?#?\d+\b")  # only in comments and docstrings: "#333" is a colour


def prose(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in a module's source."""
    found = [(tok.start[0], tok.string[1:]) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return found


def citations(folders: list[Path], anywhere: re.Pattern = ANYWHERE) -> list[str]:
    """`path:line: text` of every line under `folders` that cites a date or an issue number (`anywhere`: what counts
    in code as well as in prose)."""
    problems = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            text = path.read_text()
            where = path.relative_to(folder.parent)
            problems += [f"{where}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                         if anywhere.search(line)]
            problems += [f"{where}:{n}: {line.strip()}" for n, line in prose(text) if IN_PROSE.search(line)]
    return sorted(set(problems))


def test_no_code_line_cites_a_date_or_an_issue():
    problems = citations(CODE)
    assert not problems, "say why, not when (dates and issue numbers go to docs/):\n" + "\n".join(problems)


def test_no_test_cites_an_issue():
    """The tests too, but for dates: a test may hold one as data (an evidence file's run date)."""
    planted = "tests/test_code_style.py:"  # this file's citations are the ones its own test plants
    problems = [p for p in citations([ROOT / "tests"], re.compile(ISSUE)) if not p.startswith(planted)]
    assert not problems, "say why, not when:\n" + "\n".join(problems)


def test_a_planted_date_and_issue_are_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "fine.py").write_text('"""Dense retrieval (Karpukhin et al. 2020)."""\nCOLOUR = "#333333"\n'
                                     'STAMP = "%Y-%m-%d"  # strftime, not a date\n')
    (package / "dated.py").write_text('"""Measured 2026-11-25 on an H100."""\n\n'
                                      "def f():\n"
                                      '    """Kept apart (see #53)."""\n'
                                      "    return 1  # the fix of issue 27\n")
    assert citations([package]) == ["pkg/dated.py:1: \"\"\"Measured 2026-11-25 on an H100.\"\"\"",
                                     "pkg/dated.py:4: Kept apart (see #53).",
                                     "pkg/dated.py:5: return 1  # the fix of issue 27"]

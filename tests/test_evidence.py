"""The reproduction's evidence (rag_lab/reproduction/evidence.py): per-run summaries written from run folders, the
report regenerated from them alone, and a report edited by hand caught by `--check` — no training here (the quick
reproduction in test_reproduce.py writes and checks evidence of real runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rag_lab.reproduction import command

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path("tests/fixtures/evidence")  # relative to ROOT: the report names the folder as given
EXPECTED = Path("tests/fixtures/evidence_report")
INVOCATION = {"command": "python scripts/reproduce.py --quick --only table1 table3", "date": "2026-01-01 10:00",
              "wall_seconds": 90.0, "sections": {"table1": 60.0, "table3": 30.0}, "launched": 3, "reused": 0,
              "load": [1.0, 1.5], "threads": 1, "jobs": 1}


def retriever_run(r1: float, reembedded: int, seconds: float) -> dict:
    recall = {"1": r1, "5": min(1.0, r1 + 0.2), "10": min(1.0, r1 + 0.3), "20": min(1.0, r1 + 0.4), "100": 1.0}
    history = [{"step": s, "retrieval": {"recall": {k: round(v * s / 12, 4) for k, v in recall.items()}}}
               for s in (0, 6)]
    passes = [{"reason": "buffer build", "rows": 300, "seconds": 0.41}]
    passes += [{"reason": "refresh", "rows": 300, "seconds": 0.38}] * (reembedded // 300)  # every 6 of 12 steps
    return {"recall": recall, "mrr@10": round(r1 + 0.05, 4), "reembedded_passages": reembedded, "steps": 12,
            "steps_per_second": 3.2, "wall_seconds": seconds, "history": history, "corpus_passes": passes,
            "grad_ratio_by_step": [1.0] * 12}


def rlm_run(em: float) -> dict:
    ems = {"nq": em, "tqa": em + 0.05, "hotpotqa": em / 2}
    return {"em": ems, "reembedded_passages": 0, "steps": 6, "steps_per_second": 1.7, "wall_seconds": 21.37,
            "retriever_trained_from_step": 2, "answer_recall@4": {d: min(1.0, 2 * v) for d, v in ems.items()},
            "history": [{"step": s, **{d: {"em": v * s / 6, "recall@4": v * s / 3} for d, v in ems.items()}}
                        for s in (0, 3)]}


def make_runs(runs: Path) -> None:
    """Three finished quick runs (Table 1 stale and exhaustive from the LM init, Table 3 corrector) with their
    config.yaml naming their own folder, and the invocation that launched them."""
    for name, metrics in (("table1/lm/stale-seed0", retriever_run(0.2, 0, 11.52)),
                          ("table1/lm/exhaustive-seed0", retriever_run(0.3, 600, 14.08)),
                          ("table3/corrector-seed0", rlm_run(0.1))):
        out = runs / name
        out.mkdir(parents=True)
        (out / "metrics.json").write_text(json.dumps(metrics))
        (out / "config.yaml").write_text(f"train:\n  output_dir: {out.resolve()}\n  seed: 0\n")
    (runs / "invocations.json").write_text(json.dumps([INVOCATION]))


@pytest.fixture
def machine(monkeypatch):
    """A fixed machine line: the evidence records the one its report names."""
    monkeypatch.setattr(command, "describe_machine", lambda: "Test CPU, 2 cores, torch x")


@pytest.fixture
def in_repo(monkeypatch, machine):
    """From the repository root: the report names the evidence folder as given."""
    monkeypatch.chdir(ROOT)


def test_evidence_written_from_run_folders_is_the_committed_fixture(tmp_path, monkeypatch, machine):
    """The same runs give the same bytes wherever their folder is: the runs folder is `<runs>`, the wall times sit
    under `timing`, and only finished runs have a summary."""
    monkeypatch.chdir(tmp_path)  # `--runs runs` as given, the usual relative folder
    make_runs(Path("runs"))
    command.main(["--quick", "--report-only", "--seeds", "0", "--runs", "runs", "--out", "report",
                  "--evidence", "evidence"])
    evidence, fixture = tmp_path / "evidence", ROOT / FIXTURE
    written = sorted(p.relative_to(evidence) for p in evidence.rglob("*.json"))
    assert written == sorted(p.relative_to(fixture) for p in fixture.rglob("*.json"))
    for name in written:
        assert (evidence / name).read_bytes() == (fixture / name).read_bytes(), name
    exhaustive = json.loads((evidence / "table1/lm/exhaustive-seed0.json").read_text())
    assert exhaustive["timing"] == {"wall_seconds": 14.08, "corpus_pass_seconds": [0.41, 0.38, 0.38]}
    assert exhaustive["metrics"]["corpus_passes"][1] == {"reason": "refresh", "rows": 300}
    assert "grad_ratio_by_step" not in exhaustive["metrics"]  # a value per step: no report reads it
    assert "train.output_dir=<runs>/table1/lm/exhaustive-seed0" in exhaustive["command"]
    assert str(tmp_path) not in json.dumps(exhaustive)
    assert all((evidence / name).stat().st_size < 4000 for name in written)


def test_evidence_holds_the_only_sections_runs_alone(tmp_path, monkeypatch, machine):
    """One runs folder holds Table 1's and Table 3's runs; `--only table3 --evidence` writes Table 3's summary and the
    meta, not Table 1's runs (they are another section's), and the report from that evidence has no Table 1 rows."""
    monkeypatch.chdir(tmp_path)
    make_runs(Path("runs"))
    command.main(["--quick", "--report-only", "--only", "table3", "--seeds", "0", "--runs", "runs", "--out", "report",
                  "--evidence", "evidence"])
    written = sorted(p.relative_to(tmp_path / "evidence").as_posix() for p in (tmp_path / "evidence").rglob("*.json"))
    assert written == ["reproduce.json", "table3/corrector-seed0.json"]
    assert ((tmp_path / "evidence" / "table3/corrector-seed0.json").read_bytes()
            == (ROOT / FIXTURE / "table3/corrector-seed0.json").read_bytes())
    command.main(["--from-evidence", "evidence", "--out", "again"])
    assert "| exhaustive | 1 | 600 |" in (tmp_path / "report" / "reproduction.md").read_text()  # from the runs
    assert "| exhaustive | 1 | 600 |" not in (tmp_path / "again" / "reproduction.md").read_text()


def test_report_from_the_committed_evidence_is_the_committed_report(tmp_path, in_repo):
    """--from-evidence needs no run folder: its seeds, budget and runs folder come from the evidence. The links to
    the docs are re-rooted to the folder written into: from tests/fixtures/evidence_report they climb three folders
    to docs/, from a scratch folder they take the path from there."""
    command.main(["--from-evidence", str(FIXTURE), "--out", str(tmp_path)])
    expected = (EXPECTED / "reproduction.md").read_text()
    assert expected.count("](../../../docs/") == 4 and "](../" not in expected.replace("](../../../docs/", "")
    docs = os.path.relpath(ROOT / "docs", tmp_path)
    assert (tmp_path / "reproduction.md").read_text() == expected.replace("](../../../docs/", f"]({docs}/")
    command.main(["--from-evidence", str(FIXTURE), "--out", str(EXPECTED), "--check"])  # writes nothing there
    assert not (EXPECTED / "figures").exists()


def test_a_report_edited_by_hand_is_caught(tmp_path, in_repo):
    text = (EXPECTED / "reproduction.md").read_text()
    assert "| exhaustive | 1 | 600 | 30.0 |" in text
    (tmp_path / "reproduction.md").write_text(text.replace("| exhaustive | 1 | 600 | 30.0 |",
                                                           "| exhaustive | 1 | 600 | 31.0 |"))
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.startswith("| exhaustive | 1 | 600 |"))
    with pytest.raises(SystemExit, match=f"{tmp_path / 'reproduction.md'}: differs from what {FIXTURE} gives "
                                         f"\\(line {line} is '\\| exhaustive \\| 1 \\| 600 \\| 31.0 \\|.*; "
                                         f"regenerate it: python scripts/reproduce.py --from-evidence {FIXTURE} "
                                         f"--out {tmp_path}\\)"):
        command.main(["--from-evidence", str(FIXTURE), "--out", str(tmp_path), "--check"])


def test_a_report_goes_to_docs_generated_only_from_a_run_of_every_section(in_repo):
    """The committed report is replaced only by a full run (or an explicit --out): a run of some sections, a quick run
    and a report from one section's evidence write beside their runs or evidence (a `--only dynnibal` run once
    replaced docs/generated/reproduction.md with a report of that section alone)."""
    every = list(command.sections())
    assert command.parse_args([]).out == Path("docs/generated")
    assert command.parse_args(["--only", *every]).out == Path("docs/generated")
    assert command.parse_args(["--only", "dynnibal"]).out == Path("runs/reproduce/report")
    assert command.parse_args(["--only", "dynnibal", "--runs", "R"]).out == Path("R/report")
    assert command.parse_args(["--quick"]).out == Path("runs/reproduce-quick/report")
    assert command.parse_args(["--from-evidence", str(FIXTURE)]).out == FIXTURE / "report"
    assert command.parse_args(["--only", "dynnibal", "--out", "docs/generated"]).out == Path("docs/generated")


def test_from_evidence_names_a_missing_folder(tmp_path, in_repo):
    with pytest.raises(FileNotFoundError, match="reproduce.json: no evidence there"):
        command.main(["--from-evidence", str(tmp_path / "none")])


COMMITTED = [(Path("docs/evidence/reproduction"), Path("docs/generated")),
             (Path("docs/evidence/corrector_regime"), Path("docs/evidence/corrector_regime/report")),
             (Path("docs/evidence/large_batches"), Path("docs/evidence/large_batches/report")),
             (Path("docs/evidence/dynnibal"), Path("docs/evidence/dynnibal/report")),
             (Path("docs/evidence/generative"), Path("docs/evidence/generative/report"))]


@pytest.mark.parametrize("evidence, report", COMMITTED, ids=[str(e) for e, _ in COMMITTED])
def test_every_committed_report_is_what_its_committed_evidence_gives(evidence, report, in_repo):
    """docs/generated/reproduction.md and the reports under docs/evidence, regenerated from their runs' committed
    summaries: a number edited by hand, or evidence added without regenerating the report, fails here."""
    command.main(["--from-evidence", str(evidence), "--out", str(report), "--check"])


def doc_snippets(doc: Path) -> list[str]:
    """The ```python blocks of a doc that print a table from committed evidence (they read docs/evidence/)."""
    text, blocks = doc.read_text(), []
    for part in text.split("```python\n")[1:]:
        code = part.split("```\n", 1)[0]
        if "docs/evidence/" in code and "print(" in code:
            blocks.append(code)
    return blocks


SNIPPET_DOCS = ["corrector_regime.md", "dynnibal.md", "generative_retrieval.md", "large_batches.md", "rlm_toy.md",
                "toy_world.md"]


@pytest.mark.parametrize("name", SNIPPET_DOCS)
def test_a_docs_table_printed_from_evidence_is_what_its_snippet_prints(name, in_repo, capsys):
    """docs/corrector_regime.md, dynnibal.md, generative_retrieval.md, large_batches.md, rlm_toy.md and toy_world.md
    render their tables (with the sections' own code where a section made the runs) from the committed evidence, and
    show the snippet beside the table: run here, each snippet's output must appear in the doc as written (a number
    edited by hand, or evidence added without re-rendering the table, fails)."""
    doc = ROOT / "docs" / name
    snippets = doc_snippets(doc)
    assert snippets, f"docs/{name} has no snippet reading docs/evidence/"
    for code in snippets:
        exec(compile(code, str(doc), "exec"), {})
        printed = capsys.readouterr().out.strip()
        assert printed and printed in doc.read_text(), printed[:200]

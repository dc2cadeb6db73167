"""The fault matrix in CI: the quick cells of tests/fault_matrix.py — for every entry point that writes,
a kill at a random write and the resume, a full disk at a few of its writes (each resumed), a read-only output folder
and every damaged input it reads — must end as documented (exit status, one `error:` line naming the path, nothing
lost or half-written, the resumed run equal to the uninterrupted one) and as docs/generated/fault_matrix.json records;
the table in docs/reliability.md must be the one generated from docs/generated/fault_matrix.json.

`python tests/fault_matrix.py --full` runs every cell (a full disk at every write) and rewrites both files."""

from __future__ import annotations

import json
import random

import pytest

import fault_matrix as fm

# one xdist worker runs the whole file: its quick cells run once, in the module fixture (about 100 s)
pytestmark = pytest.mark.xdist_group("test_fault_matrix")


@pytest.fixture(scope="module")
def quick_cells(recipe_toy_dir, tmp_path_factory, zygote) -> list:
    work = tmp_path_factory.mktemp("fault-matrix")
    matrix = fm.Matrix(work, recipe_toy_dir, zygote, random.Random(fm.SEED))
    return matrix.run(list(fm.QUICK_ENTRIES), quick=True)


@pytest.mark.parametrize("entry", fm.QUICK_ENTRIES)
def test_the_quick_cells_end_as_documented_and_recorded(quick_cells, entry):
    cells = [cell for cell in quick_cells if cell.entry == entry]
    assert cells
    failed = [f"{cell.key()}: exit {cell.status}: {'; '.join(cell.problems)}" for cell in cells if not cell.ok]
    assert not failed, "\n".join(failed)
    recorded = {f"{c['entry']} | {c['fault']} | {c['where']}": c for c in json.loads(fm.RESULTS.read_text())["cells"]}
    for cell in cells:
        assert cell.key() in recorded and recorded[cell.key()]["quick"], \
            f"{cell.key()}: not in docs/generated/fault_matrix.json as a quick cell; rerun python " \
            "tests/fault_matrix.py --full"
        assert fm.stable(cell.record()) == fm.stable(recorded[cell.key()]), cell.key()


def test_the_reliability_table_is_generated_from_the_matrix_results():
    results = json.loads(fm.RESULTS.read_text())
    assert fm.doc_table(fm.DOC.read_text()) == fm.render(results), \
        "docs/reliability.md's fault-matrix table was edited by hand: rerun python tests/fault_matrix.py --full"
    quick = {c["entry"] for c in results["cells"] if c["quick"]}
    assert quick == set(fm.QUICK_ENTRIES) and set(c["entry"] for c in results["cells"]) == set(fm.ENTRIES)
    assert all(c["ok"] for c in results["cells"]), [c for c in results["cells"] if not c["ok"]][:3]

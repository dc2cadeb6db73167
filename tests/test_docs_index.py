"""docs/README.md is the index of docs/: every page and folder there is named in it (a new page without its line
would be found only by listing the folder), and every page it links exists."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_index_names_every_page_and_links_only_pages_that_exist():
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+)\)", index))
    entries = {p.name + ("/" if p.is_dir() else "") for p in DOCS.iterdir() if p.name != "README.md"}
    assert sorted(entries - linked) == [], "add a line to docs/README.md for each"
    assert sorted(link for link in linked if not (DOCS / link).exists()) == []

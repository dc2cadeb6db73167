"""docs/README.md is the index of docs/: every page and folder there, and every file scripts generate into
docs/generated/, is named in it (a new page without its line would be found only by listing the folder), and every
relative link of README.md and of the pages under docs/ reaches a file that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = DOCS / "generated"
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target "title")
CODE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)  # fenced blocks: a `](` there is code, not a link
SPAN = re.compile(r"(`+)[^`]*?\1")


def links(text: str) -> list[str]:
    """The relative link targets of a markdown text, without their #anchor, outside code."""
    text = SPAN.sub("", CODE.sub("", text))
    targets = (t.split("#", 1)[0] for t in LINK.findall(text))
    return [t for t in targets if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_index_names_every_page_and_links_only_pages_that_exist():
    index = (DOCS / "README.md").read_text()
    linked = set(links(index))
    entries = {p.name + ("/" if p.is_dir() else "") for p in DOCS.iterdir() if p.name != "README.md"}
    generated = {f"generated/{p.name}" + ("/" if p.is_dir() else "") for p in GENERATED.iterdir()}
    assert sorted((entries | generated) - linked) == [], "add a line to docs/README.md for each"
    assert sorted(link for link in linked if not (DOCS / link).exists()) == []


def pages() -> list[Path]:
    """README.md and every markdown file under docs/, the reports kept as evidence (docs/evidence/*/report) included:
    the report re-roots its links to the folder it is written into."""
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def base(page: Path) -> Path:
    """The folder a page's links resolve from: a gpu_report fragment's is the page it is assembled into."""
    return GENERATED if page.parent == GENERATED / "gpu_report" else page.parent


def test_every_relative_link_of_the_docs_reaches_a_file():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in pages() for target in links(page.read_text())
              if not (base(page) / target).exists()]
    assert broken == [], "relative links to nothing (a page moved or renamed?):\n" + "\n".join(broken)


def test_the_link_finder_skips_code_anchors_and_urls():
    text = ("[a](x.md#part) ![b](fig/y.png \"title\") [c](https://example.org/z.md) [d](#here)\n"
            "`[e](inline.md)`\n```\n[f](block.md)\n```\n")
    assert links(text) == ["x.md", "fig/y.png"]

"""The README and docs/ as a reader uses them: every relative link and anchor resolves, every
file path the architecture map names exists, and the README's runnable snippets run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_doc_is_reachable_from_the_readme():
    reached = {(ROOT / "README.md").resolve()}
    frontier = [ROOT / "README.md"]
    while frontier:
        page = frontier.pop()
        for target in links(page):
            dest = (page.parent / target.partition("#")[0]).resolve()
            if dest.suffix == ".md" and dest.exists() and dest not in reached:
                reached.add(dest)
                frontier.append(dest)
    assert {p.resolve() for p in PAGES} <= reached


def test_architecture_map_names_existing_files():
    """Every path in the architecture page's module map and picture is a file or folder."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:client|worker|kernels|pagedq|tests)/[\w/.*]+)", text))
    assert len(named) > 20
    missing = []
    for path in named - {"pagedq/x/y.py", "tests/x/test_y.py"}:  # the naming rule's pattern
        path = path.rstrip(".")
        if "*" in path:
            ok = any(ROOT.glob(path))
        else:
            ok = (ROOT / path).exists()
        if not ok:
            missing.append(path)
    assert not missing, missing


def test_readme_front_page_fits_two_screens():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 130, f"README.md has {len(lines)} lines; move detail to docs/"

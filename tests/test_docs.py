"""The repository stands alone: what its code and docs point a reader to is inside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"DESIGN(\.md)?\b|STYLE\.md|\.\./shared|shared/notes|peers-2026")
"""Names of documents that guided development but are not in a user's clone."""
DOC_PATH = re.compile(r"\bdocs/[\w./-]+\.md\b")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.sh", "*.cfg", "*.toml", "Makefile", ".ci/run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in names if (ROOT / name).exists()]


def test_nothing_cites_a_document_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in tracked_text_files()
        if path.name != "test_docs.py"
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, "cites a document outside the repository:\n" + "\n".join(found)


def test_every_cited_doc_exists():
    missing = sorted(
        f"{path.relative_to(ROOT)}: {cited}"
        for path in tracked_text_files()
        for cited in DOC_PATH.findall(path.read_text(errors="replace"))
        if not (ROOT / cited).exists()
    )
    assert not missing, "cites a file docs/ does not hold:\n" + "\n".join(missing)


def test_the_design_sections_the_code_cites_exist():
    """``docs/design.md, <Section>``: each section named is a heading of that page."""
    headings = {
        line.removeprefix("## ").strip()
        for line in (ROOT / "docs" / "design.md").read_text().splitlines()
        if line.startswith("## ")
    }
    cited = set()
    for path in tracked_text_files():
        if path.name in ("test_docs.py", "design.md"):  # they show the form, quoted
            continue
        text = " ".join(path.read_text(errors="replace").split())  # citations may wrap
        for match in re.finditer(r"docs/design\.md, ([^)]*)\)", text):
            cited |= {name.strip() for name in match.group(1).split(";")}
    assert cited and cited <= headings, cited - headings

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


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to -."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return "#" + kept.replace(" ", "-")


def test_the_results_contents_list_every_section_and_point_at_them():
    text = (ROOT / "docs" / "results.md").read_text()
    sections = [line[3:].strip() for line in text.splitlines() if line.startswith("## ")]
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\((#[^)]+)\)", contents)
    wanted = [anchor(s) for s in sections if s != "Contents"]
    assert links == wanted, f"contents {links} against sections {wanted}"


def test_the_results_open_with_the_headline_figures_and_their_commands():
    """Each headline row says when it was measured and the command that reproduces it."""
    text = (ROOT / "docs" / "results.md").read_text()
    sections = [line[3:].strip() for line in text.splitlines() if line.startswith("## ")]
    assert sections[:2] == ["Contents", "Headline figures"]
    table = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    header, *rows = rows
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "what",
        "figure",
        "measured",
        "reproduce",
    ]
    for row in rows:
        what, _, when, command = (c.strip() for c in row.strip("|").split("|"))
        assert re.search(r"\d{4}-\d{2}-\d{2}", when), f"{what}: no date"
        assert "`" in command, f"{what}: no command"
    assert "## Appendix: history" in text


def test_the_results_name_no_issue_numbers_nor_commits():
    """What a figure was measured on is said by its date and what the code did, not by an
    issue number or a commit hash (a file's sha256 is a figure, and may be quoted)."""
    text = (ROOT / "docs" / "results.md").read_text()
    issues = re.findall(r"(?<![\w&])#\d+\b", text)
    hexes = [
        m.group(0)
        for m in re.finditer(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", text)
        if "sha256" not in text[max(0, m.start() - 60) : m.start()]
    ]
    assert not issues and not hexes, (issues, hexes)

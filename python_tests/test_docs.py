"""The design document lives in the repository (docs/DESIGN.md): the README
points at it and every `DESIGN.md §N` reference in the code resolves to a
section that exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["src", "include", "scripts", "python", "python_tests", "tests", "bench", "README.md"]


def referenced_sections() -> dict[str, list[str]]:
    refs: dict[str, list[str]] = {}
    for top in SOURCES:
        root = REPO / top
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in files:
            if path.suffix not in {".rs", ".h", ".c", ".py", ".sh", ".md", ".toml"}:
                continue
            for section in re.findall(r"DESIGN\.md §(\d+)", path.read_text(errors="replace")):
                refs.setdefault(section, []).append(str(path.relative_to(REPO)))
    return refs


def test_every_design_reference_resolves_to_a_section():
    text = (REPO / "docs" / "DESIGN.md").read_text()
    sections = set(re.findall(r"^## (\d+)\. ", text, re.M))
    refs = referenced_sections()
    assert refs, "no DESIGN.md § reference found: the scan is broken"
    missing = {s: files for s, files in refs.items() if s not in sections}
    assert not missing, f"references to sections docs/DESIGN.md does not have: {missing}"


def test_references_name_the_document_in_the_repository():
    stale = []
    for top in SOURCES:
        root = REPO / top
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in files:
            if path.suffix in {".rs", ".h", ".c", ".py", ".sh", ".md"} and path != Path(__file__):
                for m in re.finditer(r"(\S*)DESIGN\.md", path.read_text(errors="replace")):
                    if not m.group(1).endswith("docs/"):
                        stale.append(f"{path.relative_to(REPO)}: {m.group(0)}")
    assert not stale, stale


def test_the_readme_points_at_the_design_document():
    assert "docs/DESIGN.md" in (REPO / "README.md").read_text()

"""The design document lives in the repository (docs/DESIGN.md): the README
points at it and every `DESIGN.md §N` reference in the code and the docs
resolves to a section that exists. The README stays what a newcomer needs
(at most 300 lines, every topic page in its table); every path the README
and the docs/ pages name exists; no table row (a benchmark's figures) is
printed in two places; and the README's Layout has a line for every source
folder."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["src", "include", "scripts", "python", "python_tests", "tests", "bench", "README.md", "docs"]
README_MAX_LINES = 300


def doc_pages() -> list[Path]:
    """The README and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


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
    text = (REPO / "docs/DESIGN.md").read_text()
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
                if path == REPO / "docs" / "DESIGN.md":
                    continue  # the document itself
                for m in re.finditer(r"(\S*)DESIGN\.md", path.read_text(errors="replace")):
                    if not m.group(1).endswith("docs/"):
                        stale.append(f"{path.relative_to(REPO)}: {m.group(0)}")
    assert not stale, stale


def test_the_readme_points_at_the_design_document():
    assert "docs/DESIGN.md" in (REPO / "README.md").read_text()


def layout_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def layout_paths() -> list[str]:
    """The paths each line of the README's Layout starts with (its first
    column; a continuation line starts with spaces and names none)."""
    paths = []
    for line in layout_block().splitlines():
        if not line or line[0] == " ":
            continue
        column = re.split(r"\s{2,}", line, maxsplit=1)[0]
        paths.extend(column.split())
    return paths


def source_folders() -> list[str]:
    """Every folder of src/ that holds code beyond its own tests."""
    folders = []
    for path in sorted((REPO / "src").rglob("*")):
        if path.is_dir() and any(
            f.is_file() and f.name != "tests.rs" and f.suffix in {".rs", ".cc", ".c"} for f in path.iterdir()
        ):
            folders.append(str(path.relative_to(REPO)) + "/")
    return folders


def test_every_path_the_readme_layout_names_exists():
    paths = layout_paths()
    assert len(paths) > 20, f"the Layout block was not found or not read: {paths}"
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"README Layout names paths that do not exist: {missing}"


def test_every_source_folder_has_its_line_in_the_readme_layout():
    named = set(layout_paths())
    unnamed = [f for f in source_folders() if f not in named]
    assert not unnamed, f"source folders the README Layout does not describe: {unnamed}"


def test_every_layer_of_the_design_is_a_line_of_the_readme_layout():
    design = (REPO / "docs/DESIGN.md").read_text()
    block = design.split("## 2. Layers", 1)[1].split("```", 2)[1]
    layers = re.findall(r"^(\w+(?:/|\.rs))\s", block, re.M)
    named = set(layout_paths())
    assert layers and all(f"src/{layer}" in named for layer in layers), (layers, named)


def test_the_readme_is_what_a_newcomer_needs_and_names_every_topic_page():
    readme = (REPO / "README.md").read_text()
    lines = readme.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move a topic to docs/"
    unnamed = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in readme]
    assert not unnamed, f"docs pages the README does not point at: {unnamed}"


# A path into the repository as the docs write it: a top-level folder, then more.
PATH_IN_DOCS = re.compile(
    r"(?<![\w/.$-])((?:src|python_tests|python|scripts|bench|tests|fuzz|docs|include)/[\w./*-]*[\w/])"
)


def test_every_path_a_doc_names_exists():
    missing = []
    for page in doc_pages():
        for path in set(PATH_IN_DOCS.findall(page.read_text())):
            if "*" in path:
                found = list(REPO.glob(path))
            else:
                found = [REPO / path] if (REPO / path).exists() else []
            if not found:
                missing.append(f"{page.relative_to(REPO)}: {path}")
    assert len(doc_pages()) > 5, "docs/ pages not found"
    assert not missing, f"paths the docs name that do not exist: {missing}"


def table_rows(text: str) -> list[str]:
    """Rows of the markdown tables in ``text`` that carry a figure (a digit
    past the first cell), header and rule rows left out."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 3 and not set(line) <= set("|-: ") and any(
            re.search(r"\d", c) for c in cells[1:]
        ):
            rows.append(line.strip())
    return rows


def test_no_benchmark_row_is_printed_twice():
    seen: dict[str, str] = {}
    twice = []
    for page in doc_pages():
        for row in table_rows(page.read_text()):
            where = str(page.relative_to(REPO))
            if row in seen:
                twice.append(f"{row!r} in {seen[row]} and {where}")
            seen[row] = where
    assert seen, "no table row found: the scan is broken"
    assert not twice, twice

#!/usr/bin/env python3
"""The layer rule of docs/DESIGN.md §2, checked from the code: every
`crate::<module>` path (and `$crate::<module>` in macros) in a file of
src/<layer>/ names its own layer or one below it in the §2 block, every
module `src/lib.rs` declares is in that block, and every layer in the block
exists. Prints each violation; exits 1 if there is any.

Usage: scripts/check-layers.py [REPO]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def layers_of(design: str) -> list[str]:
    """The layer names of the §2 block, top to bottom (`ffi`, ..., `status`)."""
    section = design.split("## 2. Layers", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    names = re.findall(r"^(\w+)(?:/|\.rs)\s", block, re.M)
    if not names:
        raise SystemExit("docs/DESIGN.md §2 has no layer block")
    return names


def code_lines(text: str) -> list[tuple[int, str]]:
    """Numbered lines with `//` comments removed (doc comments too)."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("//", 1)[0] if not re.search(r'"[^"]*//', line) else line
        out.append((number, code))
    return out


def violations(repo: Path) -> list[str]:
    src = repo / "src"
    layers = layers_of((repo / "docs/DESIGN.md").read_text())
    rank = {name: i for i, name in enumerate(layers)}
    problems = []
    declared = re.findall(r"^pub mod (\w+);", (src / "lib.rs").read_text(), re.M)
    for module in declared:
        if module not in rank:
            problems.append(f"src/lib.rs declares `{module}`, which docs/DESIGN.md §2 does not place")
    for name in layers:
        if not (src / name).is_dir() and not (src / f"{name}.rs").is_file():
            problems.append(f"docs/DESIGN.md §2 names `{name}`, which src/ does not have")
    for name in layers:
        files = [src / f"{name}.rs"] if (src / f"{name}.rs").is_file() else sorted((src / name).rglob("*.rs"))
        for path in files:
            for number, code in code_lines(path.read_text()):
                for target in re.findall(r"(?<![\w:])\$?crate::(\w+)", code):
                    if target in rank and rank[target] < rank[name]:
                        problems.append(
                            f"{path.relative_to(repo)}:{number}: {name}/ uses {target}/, a layer above it"
                        )
    return problems


def main() -> int:
    repo = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    problems = violations(repo)
    for p in problems:
        print(p)
    if not problems:
        print("layers: no file uses a layer above its own")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

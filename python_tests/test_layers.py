"""The layer rule of docs/DESIGN.md §2 holds in the code
(scripts/check-layers.py), and the checker sees a violation when there is
one: an upward `use`, a macro's `$crate::` path, a module the design does
not place."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def checker():
    spec = importlib.util.spec_from_file_location("check_layers", REPO / "scripts" / "check-layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def copy_of_the_tree(tmp_path):
    shutil.copytree(REPO / "src", tmp_path / "src")
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / "docs/DESIGN.md", tmp_path / "docs/DESIGN.md")
    return tmp_path


def test_no_file_uses_a_layer_above_its_own():
    assert checker().violations(REPO) == []


def test_the_design_block_names_the_layers_top_to_bottom():
    layers = checker().layers_of((REPO / "docs/DESIGN.md").read_text())
    assert layers[0] == "ffi" and layers[-1] == "status", layers
    assert layers.index("compute_plugin") < layers.index("transfer")
    assert layers.index("transport") < layers.index("backend") < layers.index("pjrt")


def test_an_upward_use_is_named_with_its_file_and_line(copy_of_the_tree):
    store = copy_of_the_tree / "src" / "kv" / "memory.rs"
    store.write_text(store.read_text() + "\n#[allow(unused_imports)]\nuse crate::ffi::handles;\n")
    found = checker().violations(copy_of_the_tree)
    assert len(found) == 1, found
    assert found[0].startswith("src/kv/memory.rs:") and "kv/ uses ffi/" in found[0], found


def test_a_macro_path_counts_and_a_comment_does_not(copy_of_the_tree):
    runner = copy_of_the_tree / "src" / "sync" / "runner.rs"
    runner.write_text(
        runner.read_text()
        + "\n// crate::api is only named here\nmacro_rules! upward { () => { $crate::transfer::keys::x() }; }\n"
    )
    found = checker().violations(copy_of_the_tree)
    assert len(found) == 1 and "sync/ uses transfer/" in found[0], found


def test_a_module_the_design_does_not_place_is_named(copy_of_the_tree):
    lib = copy_of_the_tree / "src" / "lib.rs"
    lib.write_text(lib.read_text() + "pub mod helpers;\n")
    found = checker().violations(copy_of_the_tree)
    assert any("declares `helpers`" in p for p in found), found

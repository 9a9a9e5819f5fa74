"""Delegation to a compute plugin (docs/DESIGN.md §11) over the C API, each
case in a child process (the compute plugin is chosen per process):

- pypjrt's conformance harness against the delegating plugin on both XLA CPU
  plugins: 0 FAIL, with compile and execute exercised;
- attributes, extensions, devices and per-client choice with a good plugin;
- clear client-creation errors for a plugin that cannot be loaded, is not a
  PJRT plugin, speaks another major version, or lacks a function we need.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import library_path
from jax_harness import COMPUTE_PLUGINS, compute_plugin

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHILD = HERE / "compute_child.py"


def run_child(args, compute: str | Path, timeout=180) -> str:
    env = dict(os.environ)
    env["PJRT_CROSSHOST_LIB"] = str(library_path())
    env["PJRT_CROSSHOST_COMPUTE_PLUGIN"] = str(compute)
    proc = subprocess.run(
        [sys.executable, *map(str, args)], env=env, cwd=str(REPO),
        capture_output=True, text=True, timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"child {args} failed (exit {proc.returncode}):\n{out}"
    return out


def plugin_or_skip(kind: str) -> Path:
    path = compute_plugin(kind)
    if path is None:
        pytest.skip(f"compute plugin {kind!r} is not installed (scripts/setup.sh installs it)")
    return path


@pytest.mark.parametrize("kind", COMPUTE_PLUGINS)
def test_pypjrt_conformance_of_the_delegating_plugin_has_no_failure(kind, tmp_path):
    pytest.importorskip("pypjrt", reason="pypjrt==0.1.1 is installed by scripts/setup.sh")
    plugin = plugin_or_skip(kind)
    report = tmp_path / "conform.json"
    run_child(["-m", "pypjrt.conform", library_path(), "--json", report], plugin, timeout=600)
    result = json.loads(report.read_text())
    checks = {c["id"]: c for c in result["checks"]}
    failed = [c for c in result["checks"] if c["result"] == "fail"]
    assert not failed, failed
    for needed in ("client.create", "compile.stablehlo_text", "compile.deserialize_and_load",
                   "execute.single_device", "execute.device_complete_events", "buffer.from_host"):
        assert checks[needed]["result"] == "pass", checks[needed]
    assert result["platform"] == "crosshost"


@pytest.mark.parametrize("kind", COMPUTE_PLUGINS)
def test_a_delegating_client_takes_the_compute_plugins_devices_attributes_and_extensions(kind):
    out = run_child([CHILD, "delegated_client"], plugin_or_skip(kind))
    assert "delegated_client OK" in out, out


def test_a_missing_compute_plugin_is_a_client_creation_error(tmp_path):
    missing = tmp_path / "no-such-plugin.so"
    out = run_child([CHILD, "bad_plugin", missing, "cannot be loaded"], missing)
    assert "bad_plugin OK" in out, out


def test_a_library_without_get_pjrt_api_is_a_client_creation_error():
    libc = Path("/lib/x86_64-linux-gnu/libc.so.6")
    if not libc.exists():
        pytest.skip("no /lib/x86_64-linux-gnu/libc.so.6 on this machine")
    out = run_child([CHILD, "bad_plugin", libc, "no GetPjrtApi entry point"], libc)
    assert "bad_plugin OK" in out, out


STUB = r"""
#include <stddef.h>
#include "xla/pjrt/c/pjrt_c_api.h"
static PJRT_Error* nothing(void* args) { (void)args; return 0; }
static PJRT_Api api;
const PJRT_Api* GetPjrtApi(void) {
  api.struct_size = PJRT_Api_STRUCT_SIZE;
  api.pjrt_api_version.struct_size = PJRT_Api_Version_STRUCT_SIZE;
  api.pjrt_api_version.major_version = STUB_MAJOR;
  api.pjrt_api_version.minor_version = 114;
  void** slot = (void**)((char*)&api + offsetof(PJRT_Api, PJRT_Error_Destroy));
  size_t n = (PJRT_Api_STRUCT_SIZE - offsetof(PJRT_Api, PJRT_Error_Destroy)) / sizeof(void*);
  for (size_t i = 0; i < n; i++) slot[i] = (void*)nothing;
  api.PJRT_Client_CreateAliasBuffer = 0;
  api.PJRT_Client_FulfillAliasBuffer = 0;
  return &api;
}
"""


def stub_plugin(tmp_path, major: int) -> Path:
    src = tmp_path / "stub.c"
    src.write_text(STUB)
    lib = tmp_path / f"libstub{major}.so"
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [cc, "-shared", "-fPIC", f"-DSTUB_MAJOR={major}", "-I", str(REPO / "pjrt_c_api"),
         str(src), "-o", str(lib)],
        check=True, capture_output=True, timeout=120,
    )
    return lib


def test_a_compute_plugin_lacking_alias_buffers_is_a_client_creation_error(tmp_path):
    lib = stub_plugin(tmp_path, 0)
    out = run_child(
        [CHILD, "bad_plugin", lib, "lacks functions a delegating client needs",
         "PJRT_Client_CreateAliasBuffer", "PJRT_Client_FulfillAliasBuffer"],
        lib,
    )
    assert "bad_plugin OK" in out, out


def test_a_compute_plugin_of_another_major_version_is_a_client_creation_error(tmp_path):
    lib = stub_plugin(tmp_path, 1)
    out = run_child([CHILD, "bad_plugin", lib, "speaks PJRT C API 1.114"], lib)
    assert "bad_plugin OK" in out, out

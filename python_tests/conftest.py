"""Fixtures for the ctypes tests of libpjrt_crosshost.so.

The library comes from $PJRT_CROSSHOST_LIB, default
target/release/libpjrt_crosshost.so. Nothing is skipped: a missing library
stops the run with a message saying how to build it.

Tests marked ``@pytest.mark.isolated`` run in a child pytest process, so a
plugin crash (segfault, abort) fails that one test instead of killing the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import pjrt_ctypes as pc  # noqa: E402

_CHILD_ENV = "PJRT_CROSSHOST_TEST_CHILD"


def library_path() -> Path:
    p = os.environ.get("PJRT_CROSSHOST_LIB")
    return Path(p) if p else REPO / "target" / "release" / "libpjrt_crosshost.so"


def header_dir() -> Path:
    return REPO / "pjrt_c_api"


def compiled_c_table(
    tmp_dir: Path, includes: list[str], body: list[str], include_dirs: tuple = ()
) -> dict:
    """Builds a C11 program against the PJRT header (and ``include_dirs``)
    whose main runs ``body``, each line printing ``NAME KEY VALUE`` or
    ``NAME VALUE``; runs it and returns {(NAME, KEY or ""): VALUE}. The C
    compiler, not the ctypes mirror, is what knows the real layouts."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (cc/gcc) found"
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        *(f'#include "{h}"' for h in includes),
        "int main(void) {",
        *body,
        "  return 0;",
        "}",
    ]
    src = tmp_dir / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_dir / "layout"
    dirs = [a for d in (header_dir(), *include_dirs) for a in ("-I", str(d))]
    r = subprocess.run(
        [cc, "-std=c11", *dirs, str(src), "-o", str(exe)], capture_output=True, text=True
    )
    assert r.returncode == 0, "layout program did not compile:\n" + r.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    table = {}
    for line in out.splitlines():
        name, *key, value = line.split()
        table[(name, key[0] if key else "")] = int(value)
    return table


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "isolated: run in a child process so that a crash fails only this test"
    )


def pytest_sessionstart(session):
    lib = library_path()
    if not lib.is_file():
        pytest.exit(
            f"\npjrt-crosshost tests: the plugin library {lib} does not exist.\n"
            "Build it with `cargo build --release` (or `make build`), or point "
            "PJRT_CROSSHOST_LIB at a built libpjrt_crosshost.so.\n",
            returncode=2,
        )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("isolated") is None or os.environ.get(_CHILD_ENV):
        return None
    env = dict(os.environ, **{_CHILD_ENV: "1", "PJRT_CROSSHOST_LIB": str(library_path())})
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        str(pyfuncitem.path) + "::" + pyfuncitem.nodeid.split("::", 1)[1],
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"isolated test hung for 120s (plugin deadlock?)\n{e.stdout}\n{e.stderr}")
    if proc.returncode != 0:
        how = (
            f"CRASHED with signal {-proc.returncode}"
            if proc.returncode < 0
            else f"failed (exit {proc.returncode})"
        )
        pytest.fail(
            f"isolated child run {how}\n--- stdout ---\n{proc.stdout[-6000:]}\n"
            f"--- stderr ---\n{proc.stderr[-3000:]}",
            pytrace=False,
        )
    return True


@pytest.fixture(scope="session")
def lib_path() -> Path:
    return library_path()


@pytest.fixture(scope="session")
def api(lib_path) -> pc.Api:
    a = pc.Api(str(lib_path))
    a.initialize()
    return a


@pytest.fixture(scope="module")
def xh(api):
    """The cross-host transfers extension of ``api``, for the transfer tests."""
    import transfer_helpers as th

    return th.Transfers(api)


@pytest.fixture(params=["auto", "tcp"])
def pair(request, api):
    """The two clients of a 2-node job inside this process (node 0, node 1),
    once on the ``auto`` transport (same host: shared memory / in-process
    copy) and once forced onto ``tcp`` (the two-hosts path)."""
    import transfer_helpers as th

    c0, c1 = th.make_pair(api, transport=None if request.param == "auto" else request.param)
    yield c0, c1
    c1.destroy()
    c0.destroy()


@pytest.fixture
def auto_pair(api):
    """The two clients of a 2-node job inside this process, ``auto`` transport only."""
    import transfer_helpers as th

    c0, c1 = th.make_pair(api)
    yield c0, c1
    c1.destroy()
    c0.destroy()


@pytest.fixture
def server():
    """A KvServer of the test's own (localhost TCP), closed afterwards."""
    from kv_server import KvServer

    s = KvServer()
    yield s
    s.close()


@pytest.fixture
def client(api):
    c = api.create_client()
    yield c
    c.destroy()


@pytest.fixture
def devices(client):
    return client.devices()


def run_child_python(code: str, timeout: float = 120, **run) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter with ``pc`` (pjrt_ctypes) imported
    and ``api`` loaded and initialized. For checks that may crash the process.
    ``run``: more arguments for subprocess.run (e.g. preexec_fn)."""
    prelude = (
        "import sys, json, ctypes\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import pjrt_ctypes as pc\n"
        f"api = pc.Api({str(library_path())!r})\n"
        "api.initialize()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=timeout,
        **run,
    )


@pytest.fixture
def two_hosts():
    """A fresh two-host bed (two_hosts.TwoHostBed): hosts "a" and "b" in
    namespaces of their own, joined by a veth; every process started on it is
    killed and the bed deleted afterwards. Skips, saying why, where no bed can
    be made (not root, no `ip`/`unshare`, namespaces not permitted)."""
    import two_hosts as th

    reason = th.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no two-host bed: {reason}")
    with th.TwoHostBed() as bed:
        yield bed

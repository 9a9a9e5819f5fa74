"""Helpers for the JAX tests (test_jax_*.py).

Every JAX scenario runs in a child Python process with a timeout: a plugin
crash (JAX aborts the process on many PJRT errors) or a hang then fails that
one test instead of taking pytest down. Children get their own process group
and are killed, group and all, when they time out or a test fails.

The children load the plugin through the in-repo package (python/ first on
PYTHONPATH) with PJRT_CROSSHOST_JAX_LIBRARY pointing at the library under
test ($PJRT_CROSSHOST_LIB, default target/release/libpjrt_crosshost.so), so
an installed (possibly older) pjrt-crosshost package does not interfere.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PACKAGE_DIR = REPO / "python"
JAX_VERSION = "0.10.2"

_jax_reason: str | None = None
_jax_checked = False


def jax_skip_reason() -> str | None:
    """Why JAX cannot be used here (None when it can)."""
    global _jax_checked, _jax_reason
    if not _jax_checked:
        _jax_checked = True
        try:
            jax = importlib.import_module("jax")
            importlib.import_module("jaxlib")
            if jax.__version__ != JAX_VERSION:
                # Still run: the plugin should work; but say which JAX it is.
                print(f"note: JAX {jax.__version__} (tests written against {JAX_VERSION})")
        except Exception as e:  # noqa: BLE001 - any import failure means no JAX
            _jax_reason = (
                f"JAX cannot be imported ({type(e).__name__}: {e}); install it with "
                f"`pip install jax=={JAX_VERSION} jaxlib=={JAX_VERSION}` (scripts/setup.sh does)"
            )
    return _jax_reason


def skip_unless_jax() -> pytest.MarkDecorator:
    """A module-level ``pytestmark`` skipping the module only when JAX cannot
    be imported, with the reason."""
    reason = jax_skip_reason()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def library_path() -> Path:
    p = os.environ.get("PJRT_CROSSHOST_LIB")
    return Path(p) if p else REPO / "target" / "release" / "libpjrt_crosshost.so"


#: The compute plugins the delegated tests run on: the default (the XLA CPU
#: plugin of fastatomstruct-xla-cpu, PJRT 0.106, what `pip install
#: pjrt-crosshost[cpu]` brings) and lammps-jax-pjrt-cpu's (PJRT 0.115; its
#: wheel requires jax<=0.11.2, so scripts/setup.sh unpacks it into .cache/
#: instead of installing it).
COMPUTE_PLUGINS = ("fastatomstruct", "lammps")
LAMMPS_PLUGIN = REPO / ".cache" / "compute-plugins" / "lammps_jax_pjrt_cpu" / "pjrt_c_api_cpu_plugin.so"


def compute_plugin(kind: str = "fastatomstruct") -> Path | None:
    """Path of a compute plugin for the delegated tests, or None if absent."""
    override = os.environ.get(f"PJRT_CROSSHOST_TEST_{kind.upper()}_PLUGIN")
    if override:
        return Path(override)
    if kind == "lammps":
        return LAMMPS_PLUGIN if LAMMPS_PLUGIN.is_file() else None
    try:
        import fastatomstruct_xla_cpu

        return Path(fastatomstruct_xla_cpu.library_path())
    except (ImportError, FileNotFoundError):
        return None


def require_compute_plugin(kind: str = "fastatomstruct") -> Path:
    """The compute plugin, or skip saying how to get it."""
    path = compute_plugin(kind)
    if path is None:
        pytest.skip(
            f"compute plugin {kind!r} is not installed (scripts/setup.sh installs "
            "fastatomstruct-xla-cpu and unpacks lammps-jax-pjrt-cpu into .cache/)"
        )
    return path


def child_env(
    extra: dict[str, str] | None = None,
    *,
    use_repo_package: bool = True,
    compute: str | None = None,
) -> dict:
    """Environment for a JAX child: only the crosshost backend, the plugin
    package from the repository, the library under test. ``compute`` names
    the compute plugin (see COMPUTE_PLUGINS); None runs without one."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("PJRT_CROSSHOST_JAX_", "PJRT_CROSSHOST_CREATE_", "JAX_", "PJRT_CROSSHOST_COMPUTE_")
        )
        and k != "PJRT_NAMES_AND_LIBRARY_PATHS"
    }
    if compute is None:
        env["PJRT_CROSSHOST_COMPUTE_PLUGIN"] = ""
        env["CROSSHOST_TEST_MODE"] = "embedded"
    else:
        env["PJRT_CROSSHOST_COMPUTE_PLUGIN"] = str(require_compute_plugin(compute))
        env["CROSSHOST_TEST_MODE"] = "delegated"
    env["JAX_PLATFORMS"] = "crosshost"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if use_repo_package:
        env["PJRT_CROSSHOST_JAX_LIBRARY"] = str(library_path())
        path = [str(PACKAGE_DIR), str(HERE)]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(path)
    if extra:
        env.update(extra)
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """Kills a child we started, and its process group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def start(args: list[str], env: dict, cwd: Path | None = None, log=None) -> subprocess.Popen:
    """Starts a child Python in its own process group; output to `log` (an
    open file) or a pipe."""
    return subprocess.Popen(
        [sys.executable, *args],
        env=env,
        cwd=str(cwd or REPO),
        stdout=log if log is not None else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_python(
    args: list[str], *, timeout: float, env: dict | None = None, cwd: Path | None = None
) -> tuple[int, str]:
    """Runs a child Python; returns (exit code, output). A child still running
    at `timeout` is killed and the test fails with its output so far."""
    proc = start(args, env if env is not None else child_env(), cwd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out = proc.stdout.read() if proc.stdout else ""
        pytest.fail(f"child {args} timed out after {timeout}s; output:\n{out}")
    finally:
        kill_group(proc)
    return proc.returncode, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

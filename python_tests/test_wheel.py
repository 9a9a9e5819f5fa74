"""The JAX plugin package as a user installs it: `pip wheel .` at the
repository root runs cargo (setup.py, setuptools-rust) and makes one
platform wheel, py3-none-linux_x86_64, that carries libpjrt_crosshost.so
and the `jax_plugins` entry point. The wheel is installed with its extras
([jax,cpu]) in a fresh venv of each tested interpreter (the system Python
with JAX 0.10.2, Python 3.12 with JAX 0.12.0.1), and JAX finds the plugin
there with nothing else set: an array goes to a crosshost device, to the
other one and back, every byte checked, and the compute plugin the [cpu]
extra brings runs jit and grad on it; the README's single-process example,
run as it stands, prints what its comments say.

The wheel is built once per session, with cargo's target directory the
repository's target/ (CARGO_TARGET_DIR, unless set): after `make build` cargo
has nothing to compile. The venvs see the interpreter's own site-packages
(--system-site-packages): jax and the compute plugin come from there, and
pip installs with --no-index, so the extras' version ranges must accept
the JAX each interpreter has.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBRARY = "jax_plugins/crosshost/libpjrt_crosshost.so"
PY312_DEFAULT = Path("/root/.pyenv/versions/3.12.1/bin/python")


def _run(cmd, *, timeout, env=None, cwd=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if p.returncode != 0:
        pytest.fail(f"$ {' '.join(map(str, cmd))}\nexit {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}")
    return p


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ)
    env.setdefault("CARGO_TARGET_DIR", str(REPO / "target"))
    # A fresh release build takes minutes; one with target/ up to date, seconds.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(REPO)], timeout=1800, env=env)
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_is_platform_tagged_and_carries_the_library(wheel):
    name, version, python, abi, platform = wheel.name[: -len(".whl")].split("-")
    assert (name, python, abi) == ("pjrt_crosshost", "py3", "none"), wheel.name
    assert platform.startswith(("linux_", "manylinux")) and platform != "any", wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = f"pjrt_crosshost-{version}.dist-info"
        wheel_file = z.read(f"{meta}/WHEEL").decode()
        entry_points = z.read(f"{meta}/entry_points.txt").decode()
        metadata = z.read(f"{meta}/METADATA").decode()
        library = z.read(LIBRARY)
    assert "Root-Is-Purelib: false" in wheel_file and f"Tag: py3-none-{platform}" in wheel_file, wheel_file
    # One library, under the name the package loads; no CPython-suffixed copy.
    assert [n for n in names if n.endswith(".so")] == [LIBRARY], names
    assert library[:4] == b"\x7fELF" and b"GetPjrtApi" in library
    # Debug info stays out of the wheel (scripts/split-debug.sh's ~10 MB, not ~55).
    assert len(library) < 30 << 20, len(library)
    assert "[jax_plugins]\ncrosshost = jax_plugins.crosshost" in entry_points, entry_points
    assert 'Requires-Dist: jax<0.13,>=0.10.2; extra == "jax"' in metadata, metadata
    assert 'Requires-Dist: fastatomstruct-xla-cpu' in metadata, metadata


def _python312() -> str:
    """scripts/test.sh's Python 3.12 (the one scripts/setup.sh found)."""
    cached = REPO / ".cache" / "python312"
    if os.environ.get("PYTHON312"):
        return os.environ["PYTHON312"]
    if cached.is_file() and cached.read_text().strip():
        return cached.read_text().strip()
    return str(PY312_DEFAULT)


INTERPRETERS = [
    pytest.param(sys.executable, "0.10.2", id="system-python"),
    pytest.param(_python312(), "0.12.0.1", id="python3.12"),
]


# Run by the venv's Python, from a directory outside the repository: only
# the installed wheel can provide jax_plugins.crosshost.
CHILD = r"""
import importlib.metadata as md, json, sys
import numpy as np
import jax, jax.numpy as jnp

eps = [e for e in md.entry_points(group="jax_plugins") if e.name == "crosshost"]
d0, d1 = jax.devices("crosshost")
data = np.random.default_rng(7).integers(0, 256, size=(1 << 20) + 3, dtype=np.uint8)
x = jax.device_put(data, d0)
y = jax.device_put(x, d1)
back = np.asarray(y)
f = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4), d1)
z = jax.jit(lambda a: jnp.sin(a) @ a.T)(f)
g = jax.grad(lambda a: jnp.sum(a * a))(f)
import jax_plugins.crosshost as crosshost
print(json.dumps({
    "jax": jax.__version__,
    "prefix": sys.prefix,
    "entry_points": [[e.value, e.dist.name] for e in eps],
    "module": crosshost.__file__,
    "registered": crosshost.registered_library(),
    "packaged": str(crosshost.packaged_library()),
    "compute": crosshost.configured_compute_plugin(),
    "devices": [str(d.platform) for d in (d0, d1)],
    "on_d1": [str(d) for d in y.devices()] == [str(d1)],
    "bytes_equal": back.dtype == data.dtype and back.tobytes() == data.tobytes(),
    "jit_shape": list(z.shape),
    "grad": float(g[0, 1]),
}))
"""


def readme_single_process() -> tuple[str, list[str]]:
    """The README's single-process example and what its comments say each
    print prints ("..." for anything)."""
    readme = (REPO / "README.md").read_text()
    code = readme.split("\n## Single process\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    expected = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(") and "#" in line]
    assert expected, code
    return code, expected


@pytest.mark.parametrize("python, jax_version", INTERPRETERS)
def test_installed_wheel_moves_an_array_through_jax(wheel, python, jax_version, tmp_path):
    if not Path(python).is_file():
        pytest.skip(f"{python} not found (scripts/setup.sh looks for Python 3.12)")
    probe = subprocess.run([python, "-c", "import jax; print(jax.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != jax_version:
        pytest.skip(f"{python} has no JAX {jax_version} ({probe.stdout.strip() or probe.stderr.strip()[-200:]}): scripts/setup.sh installs it")
    venv = tmp_path / "venv"
    _run([python, "-m", "venv", "--system-site-packages", str(venv)], timeout=120)
    vpy = venv / "bin" / "python"
    _run([str(vpy), "-m", "pip", "install", "--quiet", "--no-index", f"{wheel}[jax,cpu]"], timeout=300)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PJRT_CROSSHOST_", "JAX_", "PYTHON", "VIRTUAL_ENV")) and k != "PJRT_NAMES_AND_LIBRARY_PATHS"
    }
    env["JAX_PLATFORMS"] = "crosshost"
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "child.py").write_text(CHILD)
    p = _run([str(vpy), "child.py"], timeout=300, env=env, cwd=work)
    report = json.loads(p.stdout.strip().splitlines()[-1])
    site = Path(report["prefix"]).resolve()
    assert site == venv.resolve(), report
    assert report["jax"] == jax_version, report
    # JAX found the plugin in the venv, through the wheel's entry point.
    assert report["entry_points"] == [["jax_plugins.crosshost", "pjrt-crosshost"]], report
    assert Path(report["module"]).resolve().is_relative_to(site), report
    assert report["registered"] == report["packaged"] and Path(report["packaged"]).resolve().is_relative_to(site), report
    assert report["compute"], report  # the [cpu] extra's plugin, found with nothing set
    assert report["devices"] == ["crosshost", "crosshost"] and report["on_d1"], report
    assert report["bytes_equal"], report
    assert report["jit_shape"] == [3, 3] and report["grad"] == 2.0, report

    # The README's first example, word for word, prints what it says.
    code, expected = readme_single_process()
    (work / "single.py").write_text(code)
    printed = _run([str(vpy), "single.py"], timeout=300, env=env, cwd=work).stdout.strip().splitlines()
    assert len(printed) == len(expected), (printed, expected)
    for got, want in zip(printed, expected):
        assert re.fullmatch(".*".join(map(re.escape, want.split("..."))), got), (got, want)

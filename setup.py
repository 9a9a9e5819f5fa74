"""Builds libpjrt_crosshost.so with cargo (setuptools-rust) into the wheel of
the JAX plugin package (metadata in pyproject.toml, sources in python/).

The library is a plain C-ABI cdylib that PJRT dlopens, not a CPython
extension module, so two things differ from setuptools-rust's defaults:
it keeps the name the package and PJRT load (``libpjrt_crosshost.so``, no
``.cpython-311-...`` suffix), and the wheel is tagged ``py3-none-<platform>``
(any Python 3, this machine's platform): one wheel serves every Python.

cargo builds ``--release --locked`` with the default features, the lib only,
in the crate's target/ (``CARGO_TARGET_DIR`` moves it): after
``cargo build --release`` the wheel reuses that build instead of compiling again.
The PJRT header (never committed) is fetched first if missing.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools_rust import Binding, RustExtension, Strip

ROOT = Path(__file__).resolve().parent
LIBRARY = "libpjrt_crosshost.so"
MODULE = "jax_plugins.crosshost.libpjrt_crosshost"
HEADER = ROOT / "pjrt_c_api" / "xla" / "pjrt" / "c" / "pjrt_c_api.h"


def fetch_header() -> None:
    if not HEADER.is_file():
        # Hash-checked download of the PJRT C API header (docs/DESIGN.md §9).
        env = dict(os.environ, PYTHON=sys.executable)
        subprocess.run(["bash", str(ROOT / "scripts" / "fetch-pjrt-header.sh")], check=True, env=env)


class BuildExt(build_ext):
    def run(self):
        fetch_header()
        super().run()

    def get_ext_filename(self, fullname):
        # setuptools-rust copies the cdylib to this path: its own name, not
        # a CPython extension's (asked by full or by last name).
        if fullname in (MODULE, MODULE.rsplit(".", 1)[1]):
            return os.path.join(*fullname.split(".")[:-1], LIBRARY)
        return super().get_ext_filename(fullname)


class BdistWheel(bdist_wheel):
    def get_tag(self):
        # The library does not link libpython: any CPython 3, no ABI tag.
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    rust_extensions=[
        RustExtension(
            MODULE,
            path="Cargo.toml",
            binding=Binding.NoBinding,
            # The crate's own crate types (cdylib and rlib): cargo then sees
            # the same unit as `cargo build --release` and reuses it.
            args=["--crate-type", "cdylib,rlib"],
            cargo_manifest_args=["--locked"],
            # Release also for `pip install -e .` (setuptools-rust's default
            # there is a debug build).
            debug=False,
            # Debug info stays out of the wheel (~10 MB instead of ~55), as
            # scripts/split-debug.sh keeps it out of target/release's library.
            strip=Strip.Debug,
        )
    ],
    cmdclass={"build_ext": BuildExt, "bdist_wheel": BdistWheel},
    zip_safe=False,
)

#!/usr/bin/env bash
# Installs what building and testing pjrt-crosshost needs on a fresh machine,
# skipping whatever is already there (safe to run again):
#   - libclang-dev (bindgen needs libclang), a C and a C++ compiler, protoc
#     (protobuf-compiler: the etcd client's build generates its gRPC code),
#     and etcd 3.4 (etcd-server, etcd-client: the etcd store's tests run a
#     real server and list its keys with etcdctl), from apt;
#   - UCX (libucx0: the data plane across hosts, loaded at run time;
#     libucx-dev: its header, for tests/ucx_layout.rs), iproute2 (the
#     two-host test bed, scripts/two-hosts.sh) and nftables (the bed's loss,
#     duplication and partition faults, python_tests/test_bed_faults.py),
#     from apt;
#   - pytest and numpy for python_tests/, from PyPI;
#   - UCX 1.22 (the libucx-cu12 wheel) from PyPI: the plugin uses no UCX
#     before 1.14, and Debian's libucx0 is 1.13;
#   - jax and jaxlib 0.10.2 for python_tests/test_jax_*.py, from PyPI (a
#     failure only warns: those tests then skip, saying why);
#   - the compute plugins the delegation tests run on: fastatomstruct-xla-cpu
#     (the default, what `pip install pjrt-crosshost[cpu]` brings) from PyPI,
#     and lammps-jax-pjrt-cpu unpacked into .cache/compute-plugins/ (its wheel
#     requires jax<=0.11.2, so it is not installed); pypjrt for its
#     conformance harness;
#   - Python 3.12 (pyenv's 3.12.1, or $PYTHON312) with jax/jaxlib 0.12.0.1,
#     pytest, numpy and the default compute plugin, for the JAX tests on the
#     newest JAX (missing 3.12 only warns: scripts/test.sh then says so);
#   - the PJRT C API header (scripts/fetch-pjrt-header.sh, hash-checked).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup: $*"; }

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found: install a Rust toolchain (https://rustup.rs) first" >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

apt_pkgs=()
if ! dpkg -s libclang-dev >/dev/null 2>&1; then apt_pkgs+=(libclang-dev); fi
if ! command -v cc >/dev/null 2>&1; then apt_pkgs+=(gcc libc6-dev); fi
# The v5 descriptor-pointer shim (src/ffi/cxx/) is C++.
if ! command -v c++ >/dev/null 2>&1; then apt_pkgs+=(g++); fi
if ! command -v protoc >/dev/null 2>&1; then apt_pkgs+=(protobuf-compiler); fi
if [ ! -x /usr/bin/etcd ] && [ ! -x /usr/local/bin/etcd ]; then apt_pkgs+=(etcd-server); fi
if ! command -v etcdctl >/dev/null 2>&1; then apt_pkgs+=(etcd-client); fi
if ! dpkg -s libucx0 >/dev/null 2>&1; then apt_pkgs+=(libucx0); fi
if ! dpkg -s libucx-dev >/dev/null 2>&1; then apt_pkgs+=(libucx-dev); fi
if ! command -v ip >/dev/null 2>&1; then apt_pkgs+=(iproute2); fi
if ! command -v nft >/dev/null 2>&1 && [ ! -x /usr/sbin/nft ]; then apt_pkgs+=(nftables); fi
# The TLS etcd tests make their certificates with openssl.
if ! command -v openssl >/dev/null 2>&1; then apt_pkgs+=(openssl); fi
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  say "installing ${apt_pkgs[*]} with apt-get"
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y "${apt_pkgs[@]}"
fi

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import pytest, numpy" >/dev/null 2>&1; then
  say "installing pytest and numpy with pip"
  if ! "$PYTHON" -m pip install --quiet pytest numpy; then
    # Debian's system Python refuses plain pip installs (PEP 668).
    "$PYTHON" -m pip install --quiet --break-system-packages pytest numpy
  fi
fi

JAX_VERSION=0.10.2
if ! "$PYTHON" -c "import jax, jaxlib, sys; sys.exit(not (jax.__version__ == jaxlib.__version__ == '$JAX_VERSION'))" >/dev/null 2>&1; then
  say "installing jax==$JAX_VERSION jaxlib==$JAX_VERSION with pip"
  if ! "$PYTHON" -m pip install --quiet "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" &&
     ! "$PYTHON" -m pip install --quiet --break-system-packages "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"; then
    say "WARNING: could not install jax/jaxlib $JAX_VERSION; the JAX tests will be skipped"
  fi
fi

pip_install() {
  local py="$1"; shift
  "$py" -m pip install --quiet "$@" || "$py" -m pip install --quiet --break-system-packages "$@"
}

COMPUTE_CPU="fastatomstruct-xla-cpu==2026.6.23"
if ! "$PYTHON" -c "import fastatomstruct_xla_cpu, pypjrt" >/dev/null 2>&1; then
  say "installing $COMPUTE_CPU and pypjrt==0.1.1 with pip"
  pip_install "$PYTHON" "$COMPUTE_CPU" "pypjrt==0.1.1" ||
    say "WARNING: could not install $COMPUTE_CPU / pypjrt; the delegation tests will be skipped"
fi

# UCX 1.14 or later for the data plane between hosts: Debian's libucx0 is
# 1.13, which a stranger's failed wire-up aborts, so the plugin does not use
# it (src/transport/ucx/library.rs). The libucx wheel carries 1.22; the
# tests point the plugin at it (scripts/test.sh).
UCX_WHEEL="libucx-cu12==1.22.0"
if ! "$PYTHON" -c "import libucx, sys; sys.exit(tuple(map(int, libucx.__version__.split('.')[:2])) < (1, 14))" >/dev/null 2>&1; then
  say "installing $UCX_WHEEL with pip (UCX 1.14 or later for the data plane between hosts)"
  pip_install "$PYTHON" "$UCX_WHEEL" ||
    say "WARNING: could not install $UCX_WHEEL; transfers between hosts fall back to TCP and the UCX tests skip"
fi

LAMMPS_DIR=.cache/compute-plugins
if [ ! -f "$LAMMPS_DIR/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so" ]; then
  say "unpacking lammps-jax-pjrt-cpu==0.11.2 into $LAMMPS_DIR (not installed: it requires jax<=0.11.2)"
  mkdir -p .cache/wheels "$LAMMPS_DIR"
  if "$PYTHON" -m pip download --quiet --no-deps --dest .cache/wheels "lammps-jax-pjrt-cpu==0.11.2"; then
    "$PYTHON" -m zipfile -e .cache/wheels/lammps_jax_pjrt_cpu-0.11.2-*.whl "$LAMMPS_DIR"
  else
    say "WARNING: could not fetch lammps-jax-pjrt-cpu; its delegation tests will be skipped"
  fi
fi

# The newest JAX needs Python 3.12.
PYTHON312="${PYTHON312:-}"
if [ -z "$PYTHON312" ]; then
  # A pyenv shim answers to python3.12 even when 3.12 is not selected, so
  # each candidate must really run as 3.12.
  for candidate in "$HOME/.pyenv/versions/3.12.1/bin/python" /root/.pyenv/versions/3.12.1/bin/python \
      "$(command -v python3.12 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
      PYTHON312="$candidate"; break
    fi
  done
fi
if [ -n "$PYTHON312" ]; then
  JAX12=0.12.0.1
  if ! "$PYTHON312" -c "import jax, jaxlib, pytest, numpy, fastatomstruct_xla_cpu, sys; sys.exit(jax.__version__ != '$JAX12')" >/dev/null 2>&1; then
    say "installing jax==$JAX12, pytest, numpy and $COMPUTE_CPU for $PYTHON312"
    pip_install "$PYTHON312" "jax==$JAX12" "jaxlib==$JAX12" pytest numpy "$COMPUTE_CPU" ||
      say "WARNING: could not set up JAX $JAX12 on $PYTHON312; its tests will be skipped"
  fi
  echo "$PYTHON312" > .cache/python312
else
  say "WARNING: no Python 3.12 found (set PYTHON312); the JAX 0.12 tests will be skipped"
  rm -f .cache/python312
fi

scripts/fetch-pjrt-header.sh
say "ok"

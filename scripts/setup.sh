#!/usr/bin/env bash
# Installs what building and testing pjrt-crosshost needs on a fresh machine,
# skipping whatever is already there (safe to run again):
#   - libclang-dev (bindgen needs libclang), a C and a C++ compiler, from apt;
#   - pytest and numpy for python_tests/, from PyPI;
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

scripts/fetch-pjrt-header.sh
say "ok"

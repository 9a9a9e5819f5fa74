#!/usr/bin/env bash
# Installs the JAX plugin package (python/, distribution name pjrt-crosshost):
# copies the built plugin library into python/jax_plugins/crosshost/ and
# pip-installs ./python. Build the library first (cargo build --release).
#   PJRT_CROSSHOST_LIB  library to ship (default target/release/libpjrt_crosshost.so)
#   PYTHON              interpreter whose pip installs it (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

LIB="${PJRT_CROSSHOST_LIB:-target/release/libpjrt_crosshost.so}"
PYTHON="${PYTHON:-python3}"
if [ ! -f "$LIB" ]; then
  echo "install-python-plugin: $LIB not found; build it with 'cargo build --release'" >&2
  exit 1
fi
cp "$LIB" python/jax_plugins/crosshost/libpjrt_crosshost.so

install() { "$PYTHON" -m pip install --quiet --no-deps --force-reinstall "$@" ./python; }
# In order: the normal isolated build; without network, an installed
# setuptools (+wheel) builds it; Debian's system Python refuses plain pip
# installs (PEP 668) and needs --break-system-packages.
install || install --no-build-isolation ||
  install --break-system-packages || install --no-build-isolation --break-system-packages
echo "install-python-plugin: installed pjrt-crosshost with $LIB"

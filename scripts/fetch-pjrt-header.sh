#!/usr/bin/env bash
# Fetches pjrt_c_api.h (PJRT C API 0.114) from the PyPI sdist pypjrt==0.1.1,
# verifies the sdist and header sha256 (docs/DESIGN.md §9) and unpacks the header
# into pjrt_c_api/xla/pjrt/c/. The header is never committed. setup.py runs
# it (PYTHON: the interpreter whose pip downloads) when a wheel build lacks it.
set -euo pipefail
cd "$(dirname "$0")/.."
SDIST_SHA=e85e8fd382801726f9b8d1348deeebe5fb3aab35e95147c09d693cc701190dec
HEADER_SHA=a38827698466b7ac81b2402ad144d027a8566714d94d649fba74a37be464ece4
DEST=pjrt_c_api/xla/pjrt/c/pjrt_c_api.h

if [ -f "$DEST" ] && echo "$HEADER_SHA  $DEST" | sha256sum -c --status; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m pip download --quiet --no-deps --no-binary :all: pypjrt==0.1.1 -d "$work"
sdist="$work/pypjrt-0.1.1.tar.gz"
echo "$SDIST_SHA  $sdist" | sha256sum -c --status || {
  echo "fetch-pjrt-header: sdist sha256 mismatch for $sdist" >&2; exit 1; }
tar -xzf "$sdist" -C "$work" pypjrt-0.1.1/vendor/xla/pjrt/c/pjrt_c_api.h
hdr="$work/pypjrt-0.1.1/vendor/xla/pjrt/c/pjrt_c_api.h"
echo "$HEADER_SHA  $hdr" | sha256sum -c --status || {
  echo "fetch-pjrt-header: header sha256 mismatch" >&2; exit 1; }
mkdir -p "$(dirname "$DEST")"
cp "$hdr" "$DEST"
echo "fetch-pjrt-header: $DEST verified"

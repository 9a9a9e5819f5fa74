#!/usr/bin/env bash
# Moves a built library's debug info (line tables, and the debug info of the
# prebuilt standard library, which no profile setting removes) into
# LIB.debug beside it, linked by .gnu_debuglink: the library a user loads or
# ships stays ~10 MB instead of ~55, and gdb, perf and addr2line still find
# file:line through the link. Idempotent: a library without .debug_info is
# left as it is.
#   split-debug.sh LIB
set -euo pipefail
LIB="$1"
if ! command -v objcopy >/dev/null; then
  echo "split-debug: objcopy (binutils) not found; $LIB keeps its debug info" >&2
  exit 0
fi
if ! readelf -S "$LIB" | grep -q '\.debug_info'; then
  exit 0
fi
# objcopy writes new files, so the copy cargo keeps under deps/ (a hard link
# to LIB) is left whole and cargo's own fingerprints stay valid.
objcopy --only-keep-debug "$LIB" "$LIB.debug.tmp"
objcopy --strip-debug --remove-section=.gnu_debuglink "$LIB" "$LIB.stripped.tmp"
mv "$LIB.debug.tmp" "$LIB.debug"
(cd "$(dirname "$LIB")" && objcopy --add-gnu-debuglink="$(basename "$LIB").debug" \
  "$(basename "$LIB").stripped.tmp")
mv "$LIB.stripped.tmp" "$LIB"
echo "split-debug: $LIB $(stat -c %s "$LIB") bytes, debug info in $LIB.debug"

#!/usr/bin/env bash
# Short fuzzing pass: every cargo-fuzz target of fuzz/ for a few seconds over
# the committed seeds (fuzz/seeds/<target>) and minimized corpus
# (fuzz/corpus/<target>). Exits non-zero if any target crashes (a panic,
# failed assertion, sanitizer report, timeout or out-of-memory); the
# crashing input is left under fuzz/artifacts/<target>/.
#
#   scripts/fuzz-short.sh                 all targets, 5 s each
#   FUZZ_SECONDS=60 scripts/fuzz-short.sh  longer
#   scripts/fuzz-short.sh receipt keys    some targets
#
# Needs the nightly toolchain (cargo +nightly); without it, prints SKIPPED
# and exits 0. Installs cargo-fuzz if it is missing. New inputs the fuzzer
# finds go to a temporary directory, so the committed corpus is not changed.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_TARGET=${FUZZ_SECONDS:-5}

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "SKIPPED: fuzz-short: no nightly toolchain (cargo +nightly); install it with: rustup toolchain install nightly"
  exit 0
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz-short: installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

# The plugin's build script needs the PJRT header.
scripts/fetch-pjrt-header.sh

cd fuzz
if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

echo "fuzz-short: building ${#targets[@]} targets"
cargo +nightly fuzz build

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=()
for target in "${targets[@]}"; do
  mkdir -p "$scratch/$target"
  corpora=("$scratch/$target")
  for dir in "corpus/$target" "seeds/$target"; do
    [ -d "$dir" ] && corpora+=("$dir")
  done
  log="$scratch/$target.log"
  if cargo +nightly fuzz run "$target" "${corpora[@]}" -- \
      -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 >"$log" 2>&1; then
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    echo "fuzz-short: $target: ok (${execs:-?} executions in ${SECONDS_PER_TARGET} s)"
  else
    echo "fuzz-short: $target: FAILED; last lines of its log:"
    tail -n 40 "$log" | sed 's/^/    /'
    failed+=("$target")
  fi
done

if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz-short: FAILED: ${failed[*]} (crashing inputs under fuzz/artifacts/)"
  exit 1
fi
echo "fuzz-short: all ${#targets[@]} targets ok"

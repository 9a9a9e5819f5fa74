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
#   FUZZ_RUNS=1000000 FUZZ_GROW_CORPUS=1 scripts/fuzz-short.sh
#                                         the long run (docs/fuzzing.md): a
#                                         number of executions per target
#                                         instead of a time, new inputs kept
#                                         in fuzz/corpus/<target>, then the
#                                         corpus minimized (cargo fuzz cmin)
#
# Needs the nightly toolchain (cargo +nightly); without it, prints SKIPPED
# and exits 0. Installs cargo-fuzz if it is missing. New inputs the fuzzer
# finds go to a temporary directory, so the committed corpus is not changed.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_TARGET=${FUZZ_SECONDS:-5}
RUNS=${FUZZ_RUNS:-}
GROW_CORPUS=${FUZZ_GROW_CORPUS:-0}
if [ -n "$RUNS" ]; then
  budget=(-runs="$RUNS")
  budget_text="$RUNS runs"
else
  budget=(-max_total_time="$SECONDS_PER_TARGET")
  budget_text="${SECONDS_PER_TARGET} s"
fi

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
  mkdir -p "$scratch/$target" "corpus/$target"
  # libFuzzer writes new inputs into the first corpus directory.
  if [ "$GROW_CORPUS" = 1 ]; then
    corpora=("corpus/$target" "seeds/$target")
  else
    corpora=("$scratch/$target" "corpus/$target")
    [ -d "seeds/$target" ] && corpora+=("seeds/$target")
  fi
  log="$scratch/$target.log"
  if cargo +nightly fuzz run "$target" "${corpora[@]}" -- \
      "${budget[@]}" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 >"$log" 2>&1; then
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    echo "fuzz-short: $target: ok (${execs:-?} executions, budget $budget_text)"
    if [ "$GROW_CORPUS" = 1 ]; then
      before=$(ls "corpus/$target" | wc -l)
      cargo +nightly fuzz cmin "$target" "corpus/$target" >>"$log" 2>&1
      echo "fuzz-short: $target: corpus $before -> $(ls "corpus/$target" | wc -l) inputs (minimized)"
    fi
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

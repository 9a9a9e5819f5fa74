#!/usr/bin/env bash
# The one GPU check, for a lent GPU machine (x86-64, no internet): builds the
# plugin in release mode offline from vendored crates, runs the CUDA tests
# (tests/cuda.rs), then the GPU benchmark (crosshost-gpu-bench: cross-process
# transfer bandwidth 1 MiB-1 GiB against a plain device-to-device copy in the
# same run, and per-buffer completion latency), and prints a short table last.
#
# Needs, carried with the working tree (both are git-ignored):
#   pjrt_c_api/            the PJRT header (scripts/fetch-pjrt-header.sh)
#   vendor/crates.tar.gz   or vendor/crates/ (scripts/vendor-crates.sh)
#
# Logs go to $OUT when set (else target/gpu-check): build.log, cuda-tests.log,
# gpu-bench.log, summary.txt. Everything is bounded to finish inside ~7.5
# minutes including the build.
#
# Exit status: 0 all passed; 1 a step failed; 2 nothing was measured because
# no CUDA device was usable (the tests then report SKIPPED with the reason).
# GPU_CHECK_QUICK=1 runs the benchmark's quick set. GPU_CHECK_SMOKE=1 runs the
# benchmark on the host backend when there is no GPU (checks this script and
# the benchmark harness, measures nothing about GPUs).
set -uo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
start=$(date +%s)
budget=${GPU_CHECK_BUDGET_S:-450}
out="${OUT:-$root/target/gpu-check}"
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
target_dir="${CARGO_TARGET_DIR:-$root/target}"

say() { echo "gpu-check: $*" | tee -a "$summary"; }
fail() { say "FAILED: $*"; exit 1; }
elapsed() { echo $(( $(date +%s) - start )); }
remaining() {
  local left=$(( budget - $(elapsed) ))
  if [ "$left" -lt 10 ]; then left=10; fi
  echo "$left"
}

# ---- inputs -------------------------------------------------------------------
header="pjrt_c_api/xla/pjrt/c/pjrt_c_api.h"
[ -f "$header" ] || fail "$header is missing: carry pjrt_c_api/ with the working tree (made by scripts/fetch-pjrt-header.sh)"
command -v cargo >/dev/null || fail "cargo not found on this machine"

if [ ! -d vendor/crates ]; then
  [ -f vendor/crates.tar.gz ] || fail "no vendored crates: run scripts/vendor-crates.sh where crates.io is reachable and carry vendor/crates.tar.gz"
  tar -C vendor -xzf vendor/crates.tar.gz || fail "unpacking vendor/crates.tar.gz"
fi
# Absolute path: the config must name this machine's copy.
cat > vendor/config.toml <<TOML
[source.crates-io]
replace-with = "vendored-sources"

[source.vendored-sources]
directory = "$root/vendor/crates"
TOML
cargo_offline=(--release --offline --config vendor/config.toml)
# The etcd client's build needs protoc; the GPU checks do not need etcd.
if ! command -v protoc >/dev/null; then cargo_offline+=(--no-default-features); fi

{
  echo "host: $(uname -n) $(uname -m), $(nproc) cores"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: nvidia-smi not found"
  fi
  cargo --version
} | tee -a "$summary"

# ---- build --------------------------------------------------------------------
say "building (release, offline) ..."
t=$(date +%s)
if ! timeout "$(remaining)" cargo build "${cargo_offline[@]}" --lib --bins >"$out/build.log" 2>&1 ||
   ! timeout "$(remaining)" cargo test "${cargo_offline[@]}" --test cuda --no-run >>"$out/build.log" 2>&1; then
  tail -30 "$out/build.log"
  fail "build (log: $out/build.log)"
fi
say "built in $(( $(date +%s) - t )) s"

# ---- CUDA tests ---------------------------------------------------------------
say "running tests/cuda.rs ..."
timeout "$(remaining)" cargo test "${cargo_offline[@]}" --test cuda >"$out/cuda-tests.log" 2>&1
tests_rc=$?
grep -E "^test |^cuda tests:" "$out/cuda-tests.log"
tests_line=$(grep -E "^cuda tests:" "$out/cuda-tests.log" || echo "cuda tests: no summary (rc $tests_rc)")
[ "$tests_rc" -eq 0 ] || { tail -20 "$out/cuda-tests.log"; fail "CUDA tests ($tests_line; log: $out/cuda-tests.log)"; }
no_gpu=0
if grep -q "SKIPPED: no CUDA driver/device" "$out/cuda-tests.log"; then
  no_gpu=1
  say "NO USABLE GPU: $(grep -m1 -o 'SKIPPED: no CUDA driver/device: .*' "$out/cuda-tests.log")"
fi

# ---- benchmark ----------------------------------------------------------------
bench_args=(--lib "$target_dir/release/libpjrt_crosshost.so")
[ "${GPU_CHECK_QUICK:-0}" = 1 ] && bench_args+=(--quick)
if [ "$no_gpu" = 1 ]; then
  if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then
    say "GPU_CHECK_SMOKE=1: running the benchmark on the host backend (no GPU figures)"
    bench_args+=(--backend host --quick)
  else
    say "$tests_line"
    say "no benchmark without a GPU (exit 2); total $(elapsed) s, logs in $out"
    exit 2
  fi
fi
say "running crosshost-gpu-bench ${bench_args[*]} ..."
timeout "$(remaining)" "$target_dir/release/crosshost-gpu-bench" "${bench_args[@]}" \
  >"$out/gpu-bench.log" 2>"$out/gpu-bench.stderr.log"
bench_rc=$?
if [ "$bench_rc" -ne 0 ]; then
  tail -20 "$out/gpu-bench.stderr.log"
  [ "$bench_rc" -eq 124 ] && fail "benchmark ran out of the time budget (log: $out/gpu-bench.stderr.log)"
  fail "benchmark exited $bench_rc (log: $out/gpu-bench.stderr.log)"
fi

# ---- summary (last) -------------------------------------------------------------
echo
say "$tests_line"
say "total $(elapsed) s; logs in $out"
tee -a "$summary" < "$out/gpu-bench.log"

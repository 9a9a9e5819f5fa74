#!/usr/bin/env bash
# The one GPU check, for a lent GPU machine (x86-64, no internet): builds the
# plugin in release mode offline from vendored crates, runs the CUDA tests
# (tests/cuda.rs), then the GPU benchmark (crosshost-gpu-bench: cross-process
# transfer bandwidth 1 MiB-1 GiB against a plain device-to-device copy in the
# same run, and per-buffer completion latency), then the cross-node path
# (issue #38: GPU buffers staged through pinned memory over TCP and over UCX,
# CUDA IPC taken out of the picture by `transport=tcp|ucx`, against the same
# transfers from host memory over the same path, measured in the same run),
# and prints a short table last. It also records once what the machine's
# image offers (jax, CUDA toolkits, cudart/cublas/nccl, ucx_info).
#
# Needs, carried with the working tree (both are git-ignored):
#   pjrt_c_api/            the PJRT header (scripts/fetch-pjrt-header.sh)
#   vendor/crates.tar.gz   or vendor/crates/ (scripts/vendor-crates.sh)
# or, for a GPU machine without cargo (the lent H200's image has none), the
# binaries built elsewhere: `scripts/gpu-check.sh --prepare` builds them here
# into target/gpu-prebuilt/ (stripped, ~15 MiB: the CUDA test binary, the GPU
# benchmark, the plugin; plus ~17 MiB of the libucx wheel's CUDA-built UCX in
# ucx-lib/ where $PJRT_CROSSHOST_UCX_WHEEL_LIB names it here); carry that
# folder and pjrt_c_api/ and run
# `GPU_CHECK_PREBUILT=target/gpu-prebuilt scripts/gpu-check.sh`. CUDA is
# loaded at run time, so binaries built without a driver run on the GPU.
# With python3, pytest and numpy there, the ctypes CUDA tests
# (python_tests/test_cuda_backend.py) run too.
#
# Logs go to $OUT when set (else target/gpu-check): build.log, cuda-tests.log,
# gpu-bench.log, cross-node-<transport>-<backend>.log, image.txt,
# summary.txt. Everything is bounded to finish inside ~9 minutes including
# the build (GPU_CHECK_BUDGET_S).
#
# Exit status: 0 all passed; 1 a step failed; 2 nothing was measured because
# no CUDA device was usable (the tests then report SKIPPED with the reason).
# GPU_CHECK_QUICK=1 runs the benchmark's quick set. GPU_CHECK_SMOKE=1 runs the
# benchmarks on the host backend when there is no GPU (checks this script and
# the benchmark harness, measures nothing about GPUs). GPU_CHECK_CROSS_NODE=0
# skips the cross-node section.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
prebuilt_dir="$root/target/gpu-prebuilt"

if [ "${1:-}" = "--prepare" ]; then
  set -e
  cargo build --release --lib --bin crosshost-gpu-bench
  tests_exe=$(cargo test --release --test cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])')
  mkdir -p "$prebuilt_dir"
  strip -o "$prebuilt_dir/cuda-tests" "$tests_exe"
  strip -o "$prebuilt_dir/crosshost-gpu-bench" target/release/crosshost-gpu-bench
  strip -o "$prebuilt_dir/libpjrt_crosshost.so" target/release/libpjrt_crosshost.so
  # The libucx wheel's UCX (built with CUDA, no verbs): one copy of each
  # library and of the modules a GPU node uses (the wheel holds 130 MiB of
  # duplicates and static archives; this is ~17 MiB, under the carry limit).
  wheel="${PJRT_CROSSHOST_UCX_WHEEL_LIB:-}"
  if [ -n "$wheel" ] && [ -f "$wheel/libucp.so.0" ]; then
    mkdir -p "$prebuilt_dir/ucx-lib/ucx"
    for lib in libucp libucs libuct libucm libucs_signal; do
      [ -f "$wheel/$lib.so.0" ] && strip -o "$prebuilt_dir/ucx-lib/$lib.so.0" "$wheel/$lib.so.0"
    done
    # The plugin looks for the wheel's libucp.so (ucx/library.rs).
    cp "$prebuilt_dir/ucx-lib/libucp.so.0" "$prebuilt_dir/ucx-lib/libucp.so"
    for module in libuct_cma libuct_cuda libucm_cuda; do
      if [ -f "$wheel/ucx/$module.so.0" ]; then
        strip -o "$prebuilt_dir/ucx-lib/ucx/$module.so.0" "$wheel/ucx/$module.so.0"
        cp "$prebuilt_dir/ucx-lib/ucx/$module.so.0" "$prebuilt_dir/ucx-lib/ucx/$module.so"
      fi
    done
  else
    echo "gpu-check: no libucx wheel named by PJRT_CROSSHOST_UCX_WHEEL_LIB: the cross-node UCX run will use the machine's UCX, if any"
  fi
  echo "gpu-check: prepared $prebuilt_dir ($(du -sh "$prebuilt_dir" | cut -f1)): carry it with pjrt_c_api/"
  exit 0
fi
start=$(date +%s)
budget=${GPU_CHECK_BUDGET_S:-540}
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

{
  echo "host: $(uname -n) $(uname -m), $(nproc) cores"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: nvidia-smi not found"
  fi
} | tee -a "$summary"

if [ -n "${GPU_CHECK_PREBUILT:-}" ]; then
  bin_dir="$(cd "$GPU_CHECK_PREBUILT" && pwd)" || fail "GPU_CHECK_PREBUILT=$GPU_CHECK_PREBUILT is not a folder"
  for f in cuda-tests crosshost-gpu-bench libpjrt_crosshost.so; do
    [ -f "$bin_dir/$f" ] || fail "$bin_dir/$f is missing: run scripts/gpu-check.sh --prepare where cargo is"
  done
  cuda_tests=("$bin_dir/cuda-tests")
  bench_exe="$bin_dir/crosshost-gpu-bench"
  plugin="$bin_dir/libpjrt_crosshost.so"
  say "using the binaries in $bin_dir (built elsewhere)"
  if [ -f "$bin_dir/ucx-lib/libucp.so.0" ] && [ -z "${PJRT_CROSSHOST_UCX_WHEEL_LIB:-}" ]; then
    export PJRT_CROSSHOST_UCX_WHEEL_LIB="$bin_dir/ucx-lib"
    say "UCX: the carried libucx wheel's libraries ($bin_dir/ucx-lib)"
  fi
else
  command -v cargo >/dev/null || fail "cargo not found on this machine (build elsewhere with --prepare and set GPU_CHECK_PREBUILT)"
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
  cargo --version | tee -a "$summary"

  say "building (release, offline) ..."
  t=$(date +%s)
  if ! timeout "$(remaining)" cargo build "${cargo_offline[@]}" --lib --bins >"$out/build.log" 2>&1 ||
     ! timeout "$(remaining)" cargo test "${cargo_offline[@]}" --test cuda --no-run >>"$out/build.log" 2>&1; then
    tail -30 "$out/build.log"
    fail "build (log: $out/build.log)"
  fi
  say "built in $(( $(date +%s) - t )) s"
  cuda_tests=(cargo test "${cargo_offline[@]}" --test cuda)
  bench_exe="$target_dir/release/crosshost-gpu-bench"
  plugin="$target_dir/release/libpjrt_crosshost.so"
fi

# ---- CUDA tests ---------------------------------------------------------------
say "running tests/cuda.rs ..."
timeout "$(remaining)" "${cuda_tests[@]}" >"$out/cuda-tests.log" 2>&1
tests_rc=$?
grep -E "^test |^cuda tests:" "$out/cuda-tests.log"
tests_line=$(grep -E "^cuda tests:" "$out/cuda-tests.log" || echo "cuda tests: no summary (rc $tests_rc)")
[ "$tests_rc" -eq 0 ] || { tail -20 "$out/cuda-tests.log"; fail "CUDA tests ($tests_line; log: $out/cuda-tests.log)"; }
no_gpu=0
if grep -q "SKIPPED: no CUDA driver/device" "$out/cuda-tests.log"; then
  no_gpu=1
  say "NO USABLE GPU: $(grep -m1 -o 'SKIPPED: no CUDA driver/device: .*' "$out/cuda-tests.log")"
fi

# ---- ctypes CUDA tests (the plugin through its C API) ----------------------------
pytest_line="ctypes cuda tests: not run (no python3 with pytest and numpy)"
if command -v python3 >/dev/null && python3 -c "import pytest, numpy" >/dev/null 2>&1; then
  say "running python_tests/test_cuda_backend.py ..."
  PJRT_CROSSHOST_LIB="$plugin" timeout "$(remaining)" python3 -m pytest -q -p no:cacheprovider \
    python_tests/test_cuda_backend.py >"$out/ctypes-tests.log" 2>&1
  pytest_rc=$?
  pytest_line="ctypes cuda tests: $(tail -1 "$out/ctypes-tests.log")"
  say "$pytest_line"
  [ "$pytest_rc" -eq 0 ] || { tail -30 "$out/ctypes-tests.log"; fail "ctypes CUDA tests (log: $out/ctypes-tests.log)"; }
fi

# ---- benchmark ----------------------------------------------------------------
bench_args=(--lib "$plugin")
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
timeout "$(remaining)" "$bench_exe" "${bench_args[@]}" \
  >"$out/gpu-bench.log" 2>"$out/gpu-bench.stderr.log"
bench_rc=$?
if [ "$bench_rc" -ne 0 ]; then
  tail -20 "$out/gpu-bench.stderr.log"
  [ "$bench_rc" -eq 124 ] && fail "benchmark ran out of the time budget (log: $out/gpu-bench.stderr.log)"
  fail "benchmark exited $bench_rc (log: $out/gpu-bench.stderr.log)"
fi

# ---- what the image offers (recorded once, for a later step) --------------------
{
  echo "python3 -c 'import jax': $(python3 -c 'import jax; print(jax.__version__)' 2>&1 | tail -1)"
  echo "ls -d /usr/local/cuda*: $(ls -d /usr/local/cuda* 2>&1 | tr '\n' ' ')"
  echo "ldconfig -p | grep -E 'cudart|cublas|nccl':"
  ldconfig -p 2>&1 | grep -E "cudart|cublas|nccl" | sed 's/^/  /'
  echo "ucx_info -v: $(ucx_info -v 2>&1 | tr '\n' ' ')"
} > "$out/image.txt" 2>&1

# ---- the cross-node path: staged through pinned memory (issue #38) ---------------
# transport=tcp|ucx forbids the same-node path (CUDA IPC): both processes
# offer and reach destinations over the network transport, so a GPU buffer
# is staged on both sides (device-to-host into the sender's pinned ring,
# host-to-device from the receiver's), every byte checked by the receiver,
# and the benchmark fails a receive ready sooner than a host-to-device copy
# of its bytes could run. Each transport runs twice in this same run: GPU
# buffers, then host buffers over the same path (the reference of the 0.8x
# target at 256 MiB).
cross_line="cross-node: not run"
row_gbps() { # log, size words ("256 MiB"), batch -> xfer GB/s
  awk -v size="$2" -v batch="$3" '($1" "$2)==size && $3==batch && $4=="|" {print $5; exit}' "$1"
}
if [ "${GPU_CHECK_CROSS_NODE:-1}" = 1 ] && { [ "$no_gpu" = 0 ] || [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; }; then
  gpu_backend=cuda
  [ "$no_gpu" = 1 ] && gpu_backend=host
  cross_rows=()
  for transport in tcp ucx; do
    if [ "$transport" = ucx ] && [ -z "${PJRT_CROSSHOST_UCX_WHEEL_LIB:-}" ] &&
       [ -z "${PJRT_CROSSHOST_UCX_LIBRARY:-}" ] && ! ldconfig -p 2>/dev/null | grep -q "libucp.so.0"; then
      say "cross-node ucx: skipped, no libucp here (carry the wheel's: --prepare with PJRT_CROSSHOST_UCX_WHEEL_LIB set)"
      continue
    fi
    for backend in "$gpu_backend" host; do
      log="$out/cross-node-$transport-$backend.log"
      if [ "$(remaining)" -le 30 ]; then
        say "cross-node $transport ($backend): skipped, out of time"
        continue
      fi
      say "running crosshost-gpu-bench --transport $transport --backend $backend ..."
      timeout "$(remaining)" "$bench_exe" --lib "$plugin" --transport "$transport" --backend "$backend" \
        >"$log" 2>"${log%.log}.stderr.log"
      rc=$?
      if [ "$rc" -ne 0 ]; then
        tail -20 "${log%.log}.stderr.log"
        fail "cross-node $transport ($backend) exited $rc (log: ${log%.log}.stderr.log)"
      fi
    done
    gpu_log="$out/cross-node-$transport-$gpu_backend.log"
    host_log="$out/cross-node-$transport-host.log"
    [ -s "$gpu_log" ] && [ -s "$host_log" ] || continue
    for case in "256 MiB:1" "1 MiB:64"; do
      size="${case%%:*}"; batch="${case##*:}"
      g=$(row_gbps "$gpu_log" "$size" "$batch"); h=$(row_gbps "$host_log" "$size" "$batch")
      [ -n "$g" ] && [ -n "$h" ] || continue
      ratio=$(awk -v g="$g" -v h="$h" 'BEGIN { if (h > 0) printf "%.2f", g / h; else print "nan" }')
      mark=""
      if [ "$case" = "256 MiB:1" ] && awk -v r="$ratio" 'BEGIN { exit !(r < 0.8) }'; then mark=" (below the 0.8x target)"; fi
      cross_rows+=("$transport $size x$batch: $gpu_backend $g GB/s, host $h GB/s, ratio $ratio$mark")
    done
  done
  cross_line="cross-node: ${#cross_rows[@]} comparisons"
fi

# ---- summary (last) -------------------------------------------------------------
echo
say "$tests_line"
say "$pytest_line"
say "$cross_line"
for row in "${cross_rows[@]+"${cross_rows[@]}"}"; do say "  $row"; done
say "image: $(tr '\n' ';' < "$out/image.txt" | cut -c1-300)"
say "total $(elapsed) s; logs in $out"
tee -a "$summary" < "$out/gpu-bench.log"
for log in "$out"/cross-node-*-*.log; do
  case "$log" in *.stderr.log) continue ;; esac
  [ -s "$log" ] && tee -a "$summary" < "$log"
done

#!/usr/bin/env bash
# The Rust test suite under AddressSanitizer (which includes LeakSanitizer
# on Linux x86_64): cargo +nightly test with -Zsanitizer=address, in its own
# target directory (target/asan) so the normal build is untouched.
#
#   scripts/sanitize.sh                  lib tests + the lifecycle, batch, KV-fault
#                                        and process-report integration tests
#   scripts/sanitize.sh --all            every test target
#
# Needs the nightly toolchain; without it prints SKIPPED and exits 0. A
# sanitizer report fails the run (exit code non-zero) and is printed.
# tests/c_program.rs (a C program dlopens the cdylib) and the forwarding
# mock load shared objects built without ASan; they run in the normal suite.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "SKIPPED: sanitize: no nightly toolchain (rustup toolchain install nightly)"
  exit 0
fi
scripts/fetch-pjrt-header.sh

target=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Zsanitizer=address -Cforce-frame-pointers=yes"
export RUSTDOCFLAGS="$RUSTFLAGS"
# Leaks are reported at exit; threads the tests detach on purpose (a stuck
# KV callback) are still running then, which LSan does not count as a leak.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=0"
export LSAN_OPTIONS="report_objects=0"
args=(--target "$target" --target-dir target/asan --release)
if [ "${1:-}" = "--all" ]; then
  tests=(--lib --bins --tests)
else
  tests=(--lib --test lifecycle --test batch_order --test kv_faults --test process_reports --test etcd_store)
fi
echo "sanitize: cargo +nightly test ${tests[*]} under AddressSanitizer + LeakSanitizer ($target)"
cargo +nightly test "${args[@]}" "${tests[@]}" 2>&1 | tee target/sanitize.log | grep -E "^test result|ERROR: (Address|Leak)Sanitizer|^failures:|FAILED" || true
status=${PIPESTATUS[0]}
if grep -q "ERROR: \(Address\|Leak\)Sanitizer" target/sanitize.log; then
  echo "sanitize: sanitizer reports (full log: target/sanitize.log):"
  grep -A30 "ERROR: \(Address\|Leak\)Sanitizer" target/sanitize.log | head -120
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "sanitize: cargo test failed (exit $status); full log: target/sanitize.log"
  exit "$status"
fi
echo "sanitize: no AddressSanitizer or LeakSanitizer report"

#!/usr/bin/env bash
# Session 26 (2026-12-04), run 82: run 80's calls again at the final code (the readback read at the call counts in
# one call): tests/gpu/cc, bench cc, and the differential fuzzer's 20,000 programs with both oracles.
set -u
LIMIT=${LIMIT:-570}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 180
bench_cc $OUT/bench-cc.log 130
fuzz_cc $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

#!/usr/bin/env bash
# Session 26 (2026-12-04), the cc review round of session 26 (compile-safe sync patches, waits under dispatch modes and
# for ended failures, uploads left to torch after offloaded writes, per-GPU spare events, registered targets by bytes,
# dual-level uploads): tests/gpu/cc (test_cc_review26.py among them), bench cc, and the differential fuzzer's 20,000
# programs with both oracles, all at the final code.
set -u
LIMIT=${LIMIT:-570}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 180
bench_cc $OUT/bench-cc.log 130
fuzz_cc $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

#!/usr/bin/env bash
# Session 25, the rest of the one-GPU regression at the review round's code (run 77 did tests/gpu/cc, bench cc and the
# fuzzer): tests/gpu/pp, the bench/compat/demo/doctor/example/trace tests, tests/gpu/syncs, tests/plugin.
set -u
LIMIT=${LIMIT:-570}
SUITE_FLAGS="-q -rfEs --durations=5 --timeout 120"
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
run_suite gpu-pp 230 tests/gpu/pp
run_suite gpu-rest 90 tests/gpu/bench tests/gpu/compat tests/gpu/test_demo_gpu.py tests/gpu/test_doctor_gpu.py \
  tests/gpu/test_example_transformers.py tests/gpu/test_trace_gpu.py
run_suite gpu-syncs 150 tests/gpu/syncs
run_suite plugin $(( $(left) - 5 )) tests/plugin
echo "== end (t=${SECONDS}s)" | tee -a $OUT/summary.log

#!/usr/bin/env bash
# Session 24, the rest of the one-GPU regression at the final code (run 74 did tests/gpu/pp and tests/plugin): tests/gpu/cc
# without the fuzzer (run 72 ran it at this cc code), the bench/compat/demo/doctor/example/trace tests, tests/gpu/syncs.
set -u
LIMIT=${LIMIT:-560}
SUITE_FLAGS="-q -rfEs --durations=5 --timeout 120"
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
run_suite gpu-cc 100 tests/gpu/cc --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz
run_suite gpu-rest 140 tests/gpu/bench tests/gpu/compat tests/gpu/test_demo_gpu.py tests/gpu/test_doctor_gpu.py \
  tests/gpu/test_example_transformers.py tests/gpu/test_trace_gpu.py
run_suite gpu-syncs $(( $(left) - 5 )) tests/gpu/syncs
echo "== end (t=${SECONDS}s)" | tee -a $OUT/summary.log

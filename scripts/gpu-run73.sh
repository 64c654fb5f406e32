#!/usr/bin/env bash
# Session 23's regression call on one H200: every one-GPU suite (tests/gpu and tests/plugin, not multi_gpu) at the final
# code, one pytest per folder so that a hang costs one slot, skips listed with their reasons.
set -u
LIMIT=${LIMIT:-560}
SUITE_FLAGS="-q -rfEs --timeout 120"
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
run_suite gpu-cc 90 tests/gpu/cc --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz
run_suite gpu-pp 60 tests/gpu/pp
run_suite gpu-rest 120 tests/gpu/bench tests/gpu/compat tests/gpu/test_demo_gpu.py tests/gpu/test_doctor_gpu.py \
  tests/gpu/test_example_transformers.py tests/gpu/test_trace_gpu.py
run_suite gpu-syncs 260 tests/gpu/syncs
run_suite plugin $(( $(left) - 5 )) tests/plugin
echo "== end (t=${SECONDS}s)" | tee -a $OUT/summary.log

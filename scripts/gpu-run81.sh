#!/usr/bin/env bash
# Session 26, after run 80 (tests/gpu/cc, bench cc, the fuzzer): the suites the shared patching change reaches
# (dynamo's handler table primed and dropped with the compiler tables): tests/gpu/syncs, tests/plugin, and the
# bench/compat/demo/doctor/example/trace tests.
set -u
LIMIT=${LIMIT:-570}
SUITE_FLAGS="-q -rfEs --durations=5 --timeout 120"
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
run_suite gpu-syncs 240 tests/gpu/syncs
run_suite gpu-rest 100 tests/gpu/bench tests/gpu/compat tests/gpu/test_demo_gpu.py tests/gpu/test_doctor_gpu.py \
  tests/gpu/test_example_transformers.py tests/gpu/test_trace_gpu.py
run_suite plugin $(( $(left) - 5 )) tests/plugin
echo "== end (t=${SECONDS}s)" | tee -a $OUT/summary.log

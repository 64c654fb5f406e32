#!/usr/bin/env bash
# Session 2026-12-02, third call: tests/gpu/cc with the fuzzer (4,000 programs) after the host-writes fix, and the
# syncs/pp suites one by one with -v so that each test's outcome is in the log.
set -u
source "$(dirname "$0")/gpu-common.sh"
T="timeout -k 5"
SYNCLESS_FUZZ_PROGRAMS=4000 $T 150 python3 -m pytest -q tests/gpu/cc -p no:cacheprovider --timeout 120 > $OUT/gpu-cc.log 2>&1
$T 200 python3 -m pytest -q -rfE -p no:cacheprovider --timeout 40 tests/gpu/pp tests/gpu/compat \
  tests/gpu/syncs/test_timeline_gpu.py tests/gpu/syncs/test_syncs_compile_graph_breaks_gpu.py \
  tests/gpu/syncs/test_syncs_via_gpu.py > $OUT/gpu-new.log 2>&1
for f in gpu-cc gpu-new; do echo "== $f"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/$f.log | tail -25; done

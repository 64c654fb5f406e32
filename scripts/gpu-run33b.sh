#!/usr/bin/env bash
# Session 2026-12-02, second call: the cc suites and fuzzer, the new syncs/pp/timeline GPU tests, the syncs and
# pp one-GPU suites, the call-count probe and bench cc / bench syncs (one H200). Logs under $OUT.
set -u
source "$(dirname "$0")/gpu-common.sh"
mkdir -p $OUT/timeline
T="timeout -k 5"
$T 50 python3 tests/gpu/cc/probe_call_counts.py --src src --label new --repeats 300 > $OUT/calls.log 2>&1
SYNCLESS_FUZZ_PROGRAMS=4000 $T 200 python3 -m pytest -q tests/gpu/cc -p no:cacheprovider --timeout 150 > $OUT/gpu-cc.log 2>&1
SYNCLESS_GPU_ARTIFACTS=$OUT/timeline $T 240 python3 -m pytest -q -p no:cacheprovider --timeout 60 \
  tests/gpu/syncs tests/gpu/compat tests/gpu/pp > $OUT/gpu-syncs-pp.log 2>&1
$T 70 python3 -m syncless bench cc --quick --out $OUT/bench-cc > $OUT/bench-cc.log 2>&1
for f in calls gpu-cc gpu-syncs-pp bench-cc; do echo "== $f"; grep -E "passed|failed|FAILED|error|goal|readback|host-bound round|1 MiB|x\)" $OUT/$f.log | tail -25; done

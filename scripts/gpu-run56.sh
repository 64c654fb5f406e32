#!/usr/bin/env bash
# Session 2026-12-03 (18), first call: the validation owed at the final code of session 17 (af942e3): tests/gpu/cc and
# the differential fuzzer's full 20,000 programs; the call counts (with names) as this session's baseline.
set -u
LIMIT=${LIMIT:-420}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 80
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_call_counts.py --repeats 300 --names > $OUT/counts.log 2>&1
head -16 $OUT/counts.log
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=240 \
  timeout -k 5 $(slot 270) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
grep -iE "programs|failures" $OUT/fuzz-default.log | tail -3; tail -1 $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

#!/usr/bin/env bash
# Session 26, run 83: the final code after the review of the round's own change and the emulator's fixes (waits
# under dispatch modes, captures noted by the emulator, global mode only skips): tests/gpu/cc and the differential
# fuzzer's 20,000 programs with both oracles (the emulator is one of them).
set -u
LIMIT=${LIMIT:-400}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 150
echo "== fuzzer (t=${SECONDS}s)"
FUZZ_S=$(( $(left) > 60 ? $(left) - 25 : 20 ))
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$FUZZ_S \
  timeout -k 5 $(slot $((FUZZ_S + 15))) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
grep -iE "cc fuzz: programs" $OUT/fuzz-default.log | tail -2; tail -1 $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

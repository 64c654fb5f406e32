#!/usr/bin/env bash
# Session 26, run 83: the final code after the review of the round's own change and the emulator's fixes (waits
# under dispatch modes, captures noted by the emulator, global mode only skips): tests/gpu/cc and the differential
# fuzzer's 20,000 programs with both oracles (the emulator is one of them).
set -u
LIMIT=${LIMIT:-400}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 150
fuzz_cc $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

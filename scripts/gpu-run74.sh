#!/usr/bin/env bash
# Session 24's follow-up to run 73 on one H200: tests/gpu/pp with a slot long enough for its 29 tests (run 73 gave it
# 60 s and it ran out after 7; each test spawns two ranks), verbose with durations so that a slow or hung test is
# named; then tests/plugin at the code whose bad-env test no longer depends on pytest's version.
set -u
LIMIT=${LIMIT:-570}
SUITE_FLAGS="-v -rfEs --durations=15 --timeout 200"
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
run_suite gpu-pp 340 tests/gpu/pp
run_suite plugin $(( $(left) - 5 )) tests/plugin
echo "== end (t=${SECONDS}s)" | tee -a $OUT/summary.log

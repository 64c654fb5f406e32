#!/usr/bin/env bash
# Session 24's follow-up to run 73 on one H200: tests/gpu/pp with a slot long enough for its 29 tests (run 73 gave it
# 60 s and it ran out after 7; each test spawns two ranks), verbose with durations so that a slow or hung test is
# named; then tests/plugin at the code whose bad-env test no longer depends on pytest's version.
set -u
LIMIT=${LIMIT:-570}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
run_suite() {  # name, slot seconds, pytest arguments...
  local name=$1 want=$2; shift 2
  echo "== $name (t=${SECONDS}s)" | tee -a $OUT/summary.log
  timeout -k 5 $(slot "$want") python3 -m pytest -v -rfEs --durations=15 -p no:cacheprovider --timeout 200 \
    -m "not multi_gpu" "$@" > $OUT/$name.log 2>&1
  echo "exit $?: $(tail -1 $OUT/$name.log)" | tee -a $OUT/summary.log
}
run_suite gpu-pp 340 tests/gpu/pp
run_suite plugin $(( $(left) - 5 )) tests/plugin
echo "== end (t=${SECONDS}s)" | tee -a $OUT/summary.log

#!/usr/bin/env bash
# Session 2026-12-03 (19), third call, the final code (the review's fixes to the read at the call: a result whose
# copy may be enqueued is kept on any failure; under CC no query after the copy): tests/gpu/cc, the bench's loop
# untimed in 15 rotated rounds, bench cc, and the differential fuzzer's 20,000 programs.
set -u
LIMIT=${LIMIT:-520}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 90
timeout -k 5 $(slot 60) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 300 --rounds 15 \
  --setups plain,floor,emulated,emulated+shim >> $OUT/diag.log 2>&1
tail -5 $OUT/diag.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 110) python3 -m syncless bench cc --out $OUT/bench-cc >> $OUT/bench-cc.log 2>&1
rm -f $OUT/bench-cc/report.md $OUT/bench-cc/cc.png
grep -E "goal|readback|1 MiB" $OUT/bench-cc.log | head -30
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$(( $(left) > 40 ? $(left) - 20 : 10 )) \
  timeout -k 5 $(slot 280) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
grep -iE "cc fuzz: programs" $OUT/fuzz-default.log | tail -2; tail -1 $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

#!/usr/bin/env bash
# Session 2026-12-03 (20), second call: the way of a small readback chosen by timing the loop both ways
# (cc/_readback_choice.py): tests/gpu/cc (with its new test), the bench's loop untimed in 15 rotated rounds against
# the look alone (+look, the code before), bench cc, and the differential fuzzer's 20,000 programs.
set -u
LIMIT=${LIMIT:-560}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 110
timeout -k 5 $(slot 70) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 300 --rounds 15 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+look >> $OUT/diag.log 2>&1
tail -6 $OUT/diag.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 120) python3 -m syncless bench cc --out $OUT/bench-cc >> $OUT/bench-cc.log 2>&1
rm -f $OUT/bench-cc/report.md $OUT/bench-cc/cc.png
grep -E "goal|readback|1 MiB" $OUT/bench-cc.log | head -30
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$(( $(left) > 40 ? $(left) - 20 : 10 )) \
  timeout -k 5 $(slot 280) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
grep -iE "cc fuzz: programs" $OUT/fuzz-default.log | tail -2; tail -1 $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

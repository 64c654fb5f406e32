#!/usr/bin/env bash
# Session 2026-12-03 (19), second call, the final code: tests/gpu/cc, call counts, the lane's pieces, the bench's
# loop untimed in 15 rotated rounds, bench cc (its host-bound rows now 15 short rotated rounds), and the
# differential fuzzer's 20,000 programs.
set -u
LIMIT=${LIMIT:-560}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 90
timeout -k 5 $(slot 45) python3 tests/gpu/cc/probe_call_counts.py --repeats 300 --names > $OUT/counts.log 2>&1
head -18 $OUT/counts.log
timeout -k 5 $(slot 30) python3 tests/gpu/cc/probe_lane_parts.py --repeats 600 > $OUT/lane.log 2>&1
grep -E "WHOLE|own" $OUT/lane.log
timeout -k 5 $(slot 60) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 300 --rounds 15 \
  --setups plain,floor,emulated,emulated+shim >> $OUT/diag.log 2>&1
tail -5 $OUT/diag.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 110) python3 -m syncless bench cc --out $OUT/bench-cc >> $OUT/bench-cc.log 2>&1
rm -f $OUT/bench-cc/report.md
grep -E "goal|readback|1 MiB" $OUT/bench-cc.log | head -30
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$(( $(left) > 40 ? $(left) - 20 : 10 )) \
  timeout -k 5 $(slot 280) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
grep -iE "cc fuzz: programs" $OUT/fuzz-default.log | tail -2; tail -1 $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

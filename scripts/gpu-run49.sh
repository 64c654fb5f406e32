#!/usr/bin/env bash
# Session 2026-12-03 (16): the helper path with one enqueue step (snapshot and record, one context check), no Thread.is_alive() per submit,
# one fence per post on x86-64: the GPU suites, probes, bench cc, and the fuzzer with the helper on and off.
set -u
LIMIT=${LIMIT:-430}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
echo "== helper + review33 (t=${SECONDS}s)" > $OUT/gpu-cc.log
timeout -k 5 $(slot 80) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 100 tests/gpu/cc/test_cc_helper.py \
  tests/gpu/cc/test_cc_review33.py >> $OUT/gpu-cc.log 2>&1
echo "== tests/gpu/cc without the fuzzer and those two (t=${SECONDS}s)" >> $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=400 timeout -k 5 $(slot 80) python3 -m pytest -q -rfE -p no:cacheprovider --timeout 60 tests/gpu/cc \
  --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz --ignore=tests/gpu/cc/test_cc_helper.py \
  --ignore=tests/gpu/cc/test_cc_review33.py >> $OUT/gpu-cc.log 2>&1
echo "== end suites (t=${SECONDS}s)" >> $OUT/gpu-cc.log
grep -E "^== |FAILED|ERROR|SKIPPED|passed|failed" $OUT/gpu-cc.log | tail -20
timeout -k 5 $(slot 20) python3 tests/gpu/cc/probe_helper.py >> $OUT/diag.log 2>&1
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_call_counts.py --repeats 300 >> $OUT/diag.log 2>&1
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 70) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
tar czf $OUT/bench-cc.tgz -C /tmp bench-cc
grep -E "goal|host-bound round|readback" $OUT/bench-cc.log | head -30
tail -25 $OUT/diag.log
half=$(( $(left) > 80 ? ($(left) - 40) / 2 : 10 ))
SYNCLESS_CC_D2H_HELPER=1 SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$half \
  timeout -k 5 $(slot $((half + 25))) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-helper.log 2>&1
tail -4 $OUT/fuzz-helper.log
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$(( $(left) > 40 ? $(left) - 25 : 10 )) \
  timeout -k 5 $(slot 300) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
tail -4 $OUT/fuzz-default.log

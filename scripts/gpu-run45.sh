#!/usr/bin/env bash
# Session 2026-12-03 (15), third call: the D2H helper's GPU tests, bench cc with its rows, the host-bound probe,
# tests/gpu/cc, the fuzzer with the helper on, and the fuzzer at 20,000 programs without it.
set -u
LIMIT=${LIMIT:-580}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
echo "== tests/gpu/cc/test_cc_helper.py (t=${SECONDS}s)" > $OUT/gpu-cc.log
timeout -k 5 $(slot 60) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 50 tests/gpu/cc/test_cc_helper.py >> $OUT/gpu-cc.log 2>&1
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 80) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
tar czf $OUT/bench-cc.tgz -C /tmp bench-cc
timeout -k 5 $(slot 50) python3 tests/gpu/cc/probe_hostbound.py --steps 200 --rounds 4 >> $OUT/diag.log 2>&1
grep -E "goal|host-bound round|readback" $OUT/bench-cc.log | head -30
grep -E "^phase|^h2d|^to_cpu|^wait_stream|^step|^launches" $OUT/diag.log
echo "== tests/gpu/cc without the fuzzer (t=${SECONDS}s)" >> $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=400 timeout -k 5 $(slot 110) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 90 \
  tests/gpu/cc --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz --ignore=tests/gpu/cc/test_cc_helper.py >> $OUT/gpu-cc.log 2>&1
echo "== the fuzzer with SYNCLESS_CC_D2H_HELPER=1 (t=${SECONDS}s)" >> $OUT/gpu-cc.log
SYNCLESS_CC_D2H_HELPER=1 SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=60 timeout -k 5 $(slot 90) python3 -m pytest -v -s -rfE \
  -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-helper.log 2>&1
tail -8 $OUT/fuzz-helper.log >> $OUT/gpu-cc.log
echo "== the fuzzer, 20,000 programs (t=${SECONDS}s)" >> $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$(( $(left) > 45 ? $(left) - 25 : 20 )) timeout -k 5 $(slot 400) python3 -m pytest -v -s -rfE \
  -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz.log 2>&1
tail -8 $OUT/fuzz.log >> $OUT/gpu-cc.log
echo "== end (t=${SECONDS}s)" >> $OUT/gpu-cc.log
grep -E "^== |PASSED|FAILED|ERROR|SKIPPED| passed| failed|programs" $OUT/gpu-cc.log | grep -v "::.*PASSED" | tail -30
grep -c PASSED $OUT/gpu-cc.log

#!/usr/bin/env bash
# Session 2026-12-03 (17), third call: the host-bound loop untimed (the bench's own loop) per readback policy, with
# what the shim did with each readback; tests/gpu/cc; call counts with names; bench cc again; the demo's GPU tests;
# the fuzzer with the D2H helper on.
set -u
LIMIT=${LIMIT:-400}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
echo "== tests/gpu/cc without the fuzzer (t=${SECONDS}s)" > $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=400 timeout -k 5 $(slot 100) python3 -m pytest -q -rfE -p no:cacheprovider --timeout 60 tests/gpu/cc \
  --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz >> $OUT/gpu-cc.log 2>&1
tail -2 $OUT/gpu-cc.log
timeout -k 5 $(slot 60) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 400 --rounds 7 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+nolook,emulated+shim+offload,emulated+shim+readnow >> $OUT/diag.log 2>&1
tail -8 $OUT/diag.log
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_call_counts.py --repeats 300 --names > $OUT/counts.log 2>&1
tail -6 $OUT/counts.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 90) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
tar czf $OUT/bench-cc.tgz -C /tmp bench-cc
grep -E "goal" $OUT/bench-cc.log | head -20
echo "== demo (t=${SECONDS}s)" > $OUT/gpu-demo.log
timeout -k 5 $(slot 70) python3 -m pytest -q -rfE -p no:cacheprovider --timeout 60 tests/gpu/test_demo_gpu.py >> $OUT/gpu-demo.log 2>&1
tail -3 $OUT/gpu-demo.log
SYNCLESS_CC_D2H_HELPER=1 SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$(( $(left) > 40 ? $(left) - 25 : 10 )) \
  timeout -k 5 $(slot 200) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-helper.log 2>&1
tail -3 $OUT/fuzz-helper.log
echo "== end (t=${SECONDS}s)"

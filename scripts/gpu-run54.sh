#!/usr/bin/env bash
# Session 2026-12-03 (17), fourth call: the readback's look at 100 us: tests/gpu/cc, the host-bound loop untimed per
# policy, bench cc.
set -u
LIMIT=${LIMIT:-250}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
echo "== tests/gpu/cc without the fuzzer (t=${SECONDS}s)" > $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=400 timeout -k 5 $(slot 100) python3 -m pytest -q -rfE -p no:cacheprovider --timeout 60 tests/gpu/cc \
  --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz >> $OUT/gpu-cc.log 2>&1
tail -2 $OUT/gpu-cc.log
timeout -k 5 $(slot 50) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 400 --rounds 7 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+readnow >> $OUT/diag.log 2>&1
tail -6 $OUT/diag.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 90) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
tar czf $OUT/bench-cc.tgz -C /tmp bench-cc
grep -E "goal" $OUT/bench-cc.log | head -20
echo "== end (t=${SECONDS}s)"

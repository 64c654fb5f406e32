#!/usr/bin/env bash
# Session 23 (2026-12-04), the final code: the readback's trial in three phases after a warm-up. tests/gpu/cc
# (test_cc_readback_choice.py among them), bench cc (each shim round's line gives the last trial's step per way),
# the differential fuzzer's 20,000 programs, and the host-bound loop untimed in 10 rotated rounds with the trials'
# readings.
set -u
LIMIT=${LIMIT:-470}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 110
bench_cc $OUT/bench-cc.log 120
grep "round .* emulated+shim:" $OUT/bench-cc.log | head -30
echo "== host-bound, untimed (t=${SECONDS}s)" | tee $OUT/hostbound-untimed.log
timeout -k 5 $(slot 50) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 300 --rounds 10 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+look,emulated+shim+offload >> $OUT/hostbound-untimed.log 2>&1
grep -E "emulated\+shim |median|Error|error" $OUT/hostbound-untimed.log
echo "== fuzzer (t=${SECONDS}s)"
FUZZ_S=$(( $(left) > 60 ? $(left) - 25 : 20 ))
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$FUZZ_S \
  timeout -k 5 $(slot $((FUZZ_S + 15))) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
grep -iE "cc fuzz: programs" $OUT/fuzz-default.log | tail -2; tail -1 $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

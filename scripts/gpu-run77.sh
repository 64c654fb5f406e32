#!/usr/bin/env bash
# Session 25 (2026-12-04), the review round's fixes (ZeroTensors left to torch, failures on several streams, a
# staged upload's failure raised once per thread, a query kicks its queue, interrupts outside a job's run, CudaError a
# RuntimeError): tests/gpu/cc (test_cc_zerotensor.py among them), bench cc at the final code, and the differential
# fuzzer's 20,000 programs with both oracles.
set -u
LIMIT=${LIMIT:-560}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 170
bench_cc $OUT/bench-cc.log 130
echo "== fuzzer (t=${SECONDS}s)"
FUZZ_S=$(( $(left) > 60 ? $(left) - 25 : 20 ))
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$FUZZ_S \
  timeout -k 5 $(slot $((FUZZ_S + 15))) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
grep -iE "cc fuzz: programs" $OUT/fuzz-default.log | tail -2; tail -1 $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

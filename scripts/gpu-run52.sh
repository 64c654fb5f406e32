#!/usr/bin/env bash
# Session 2026-12-03 (17), second call: a small readback looks for its D2H stream to drain (bounded, backing off)
# before it is offloaded; the ordering patches go straight to torch while nothing is pending; the blocking copy_
# reads no call. tests/gpu/cc, the host-bound probe, call counts, bench cc, and the fuzzer.
set -u
LIMIT=${LIMIT:-560}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
echo "== tests/gpu/cc without the fuzzer (t=${SECONDS}s)" > $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=400 timeout -k 5 $(slot 150) python3 -m pytest -q -rfE -p no:cacheprovider --timeout 60 tests/gpu/cc \
  --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz >> $OUT/gpu-cc.log 2>&1
echo "== end suites (t=${SECONDS}s)" >> $OUT/gpu-cc.log
grep -E "^== |FAILED|ERROR|SKIPPED|passed|failed" $OUT/gpu-cc.log | tail -20
timeout -k 5 $(slot 80) python3 tests/gpu/cc/probe_hostbound.py --steps 300 --rounds 5 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+nolook,emulated+shim+offload,emulated+shim+eager >> $OUT/diag.log 2>&1
grep -A12 "^phase" $OUT/diag.log
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_call_counts.py --repeats 300 > $OUT/counts.log 2>&1
tail -14 $OUT/counts.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 90) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
tar czf $OUT/bench-cc.tgz -C /tmp bench-cc
grep -E "goal|host-bound round|readback|floor" $OUT/bench-cc.log | head -40
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$(( $(left) > 40 ? $(left) - 25 : 10 )) \
  timeout -k 5 $(slot 300) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
tail -4 $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

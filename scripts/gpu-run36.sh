#!/usr/bin/env bash
# Session 2026-12-02 (13), final call: issue 33's probes, tests/gpu/cc, the differential fuzzer at 20,000 programs,
# bench cc, then the syncs timeline and signature files and the pp copy-engine file (each with a time slot).
set -u
LIMIT=${LIMIT:-585}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 40 python3 tests/gpu/cc/probe_lane_parts.py --repeats 1000 >> $OUT/diag.log 2>&1
timeout -k 5 60 python3 tests/gpu/cc/probe_hostbound.py --steps 400 --rounds 3 >> $OUT/diag.log 2>&1
timeout -k 5 30 python3 tests/gpu/cc/probe_call_counts.py --repeats 300 >> $OUT/diag.log 2>&1
echo "== tests/gpu/cc without the fuzzer (t=${SECONDS}s)" > $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=400 timeout -k 5 $(slot 100) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 90 \
  tests/gpu/cc --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz >> $OUT/gpu-cc.log 2>&1
echo "== the fuzzer, 20,000 programs (t=${SECONDS}s)" >> $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=200 timeout -k 5 $(slot 230) python3 -m pytest -v -s -rfE \
  -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz.log 2>&1
tail -25 $OUT/fuzz.log >> $OUT/gpu-cc.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 80) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
tar czf $OUT/bench-cc.tgz -C /tmp bench-cc
mkdir -p /tmp/tl
for f in tests/gpu/syncs/test_timeline_gpu.py tests/gpu/syncs/test_syncs_signatures_gpu.py tests/gpu/pp/test_copy_engine_one_gpu.py; do
  s=$(slot 200); [ "$s" -lt 20 ] && { echo "== SKIPPED (time) $f" >> $OUT/suites.log; continue; }
  echo "== $f (${s}s, t=${SECONDS}s)" >> $OUT/suites.log
  SYNCLESS_GPU_ARTIFACTS=/tmp/tl timeout -k 5 $s python3 -m pytest -v -rfE -p no:cacheprovider --timeout 150 "$f" >> $OUT/suites.log 2>&1
  echo "== rc=$? t=${SECONDS}s" >> $OUT/suites.log
done
tar czf $OUT/timeline.tgz -C /tmp tl
grep -E "^(round|phase|h2d|d2d|wait_stream|to_cpu|event|step|WHOLE|shim:|plain:|per-step|1 MiB)" $OUT/diag.log | head -40
grep -E "^== |^FAILED|^ERROR| passed| failed|programs" $OUT/gpu-cc.log $OUT/suites.log | tail -30
grep -E "host-bound|readback|1 MiB|goal" $OUT/bench-cc.log

#!/usr/bin/env bash
# Session 2026-12-02 (14), first call: the inline uploads and ctypes driver calls of issue 33 on the GPU (probes,
# tests/gpu/cc, the fuzzer at 4,000 programs), bench syncs (issues 34 and 36) and bench cc.
set -u
LIMIT=${LIMIT:-585}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
echo "== inline tests first (t=${SECONDS}s)" > $OUT/gpu-cc.log
timeout -k 5 60 python3 -m pytest -v -rfE -p no:cacheprovider --timeout 50 tests/gpu/cc/test_cc_inline_h2d.py >> $OUT/gpu-cc.log 2>&1
timeout -k 5 40 python3 tests/gpu/cc/probe_lane_parts.py --repeats 1000 >> $OUT/diag.log 2>&1
timeout -k 5 70 python3 tests/gpu/cc/probe_hostbound.py --steps 400 --rounds 3 >> $OUT/diag.log 2>&1
timeout -k 5 30 python3 tests/gpu/cc/probe_call_counts.py --repeats 300 >> $OUT/diag.log 2>&1
echo "== tests/gpu/cc without the fuzzer (t=${SECONDS}s)" >> $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=400 timeout -k 5 $(slot 110) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 90 \
  tests/gpu/cc --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz \
  --deselect tests/gpu/cc/test_cc_inline_h2d.py >> $OUT/gpu-cc.log 2>&1
echo "== the fuzzer, 4,000 programs (t=${SECONDS}s)" >> $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=4000 SYNCLESS_FUZZ_TIME_S=60 timeout -k 5 $(slot 90) python3 -m pytest -v -s -rfE \
  -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz.log 2>&1
tail -25 $OUT/fuzz.log >> $OUT/gpu-cc.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 80) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
tar czf $OUT/bench-cc.tgz -C /tmp bench-cc
echo "== bench syncs (t=${SECONDS}s)" > $OUT/bench-syncs.log
timeout -k 5 $(slot 120) python3 -m syncless bench syncs --out /tmp/bench-syncs >> $OUT/bench-syncs.log 2>&1
tar czf $OUT/bench-syncs.tgz -C /tmp bench-syncs
echo "== done t=${SECONDS}s" >> $OUT/bench-syncs.log
grep -E "^(round|phase|h2d|d2d|wait_stream|to_cpu|event|step|WHOLE|_inline|shim:|plain:|per-step|1 MiB|raw D2D)" $OUT/diag.log | head -50
grep -E "^== |^FAILED|^ERROR| passed| failed|programs" $OUT/gpu-cc.log | tail -30
grep -E "host-bound|readback|1 MiB|goal" $OUT/bench-cc.log | head -20
tail -5 $OUT/bench-syncs.log

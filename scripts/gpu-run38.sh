#!/usr/bin/env bash
# Session 2026-12-02 (14), second call: issue 33's final code (inline uploads, ctypes driver calls, small readbacks
# from an idle D2H stream as torch's own): tests/gpu/cc, the fuzzer at 20,000 programs, bench cc and the probes;
# bench syncs (issues 34 and 36); then the GPU files not run this week (doctor, trace, transformers example,
# demo, vLLM compat), each in a time slot.
set -u
LIMIT=${LIMIT:-585}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
echo "== tests/gpu/cc without the fuzzer (t=${SECONDS}s)" > $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=400 timeout -k 5 $(slot 110) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 90 \
  tests/gpu/cc --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz >> $OUT/gpu-cc.log 2>&1
echo "== the fuzzer, 20,000 programs (t=${SECONDS}s)" >> $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=200 timeout -k 5 $(slot 230) python3 -m pytest -v -s -rfE \
  -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz.log 2>&1
tail -25 $OUT/fuzz.log >> $OUT/gpu-cc.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 80) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
echo "== bench syncs (t=${SECONDS}s)" > $OUT/bench-syncs.log
timeout -k 5 $(slot 90) python3 -m syncless bench syncs --out /tmp/bench-syncs >> $OUT/bench-syncs.log 2>&1
tar czf $OUT/bench.tgz -C /tmp bench-cc bench-syncs
timeout -k 5 $(slot 30) python3 tests/gpu/cc/probe_lane_parts.py --repeats 500 >> $OUT/diag.log 2>&1
timeout -k 5 $(slot 45) python3 tests/gpu/cc/probe_hostbound.py --steps 400 --rounds 3 >> $OUT/diag.log 2>&1
timeout -k 5 $(slot 20) python3 tests/gpu/cc/probe_call_counts.py --repeats 300 >> $OUT/diag.log 2>&1
for f in tests/gpu/test_doctor_gpu.py tests/gpu/test_trace_gpu.py tests/gpu/test_demo_gpu.py tests/gpu/compat/test_vllm_compat_gpu.py tests/gpu/test_example_transformers.py; do
  s=$(slot 120); [ "$s" -lt 15 ] && { echo "== SKIPPED (time) $f" >> $OUT/suites.log; continue; }
  echo "== $f (${s}s, t=${SECONDS}s)" >> $OUT/suites.log
  timeout -k 5 $s python3 -m pytest -v -rfE -p no:cacheprovider --timeout 110 "$f" >> $OUT/suites.log 2>&1
  echo "== rc=$? t=${SECONDS}s" >> $OUT/suites.log
done
grep -E "^(round|phase|h2d|d2d|wait_stream|to_cpu|event|step|sync_prev|WHOLE|_inline|shim:|plain:|per-step|1 MiB|raw D2D)" $OUT/diag.log | head -50
grep -E "^== |^FAILED|^ERROR| passed| failed|programs" $OUT/gpu-cc.log $OUT/suites.log | tail -30
grep -E "host-bound|readback|1 MiB|goal|wrote" $OUT/bench-cc.log | head -30
tail -12 $OUT/bench-syncs.log | cut -c1-300

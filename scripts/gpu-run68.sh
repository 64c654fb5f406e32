#!/usr/bin/env bash
# Session 2026-12-04 (21), second and last call, the final code: a readback's way (the look must win by 2%; a
# pause keeps the way): tests/gpu/cc, bench cc (each loop round says what the shim did with its readbacks), the
# differential fuzzer's 20,000 programs, the GPU syncs test whose tolerance changed, and the GPU-paced loop in 15
# rotated rounds with the shim's way per round.
set -u
LIMIT=${LIMIT:-420}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 110
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 110) python3 -m syncless bench cc --out $OUT/bench-cc >> $OUT/bench-cc.log 2>&1
rm -f $OUT/bench-cc/report.md $OUT/bench-cc/cc.png
grep -E "goal|readback|1 MiB" $OUT/bench-cc.log | head -30
grep "GPU-paced round" $OUT/bench-cc.log | grep "emulated+shim:" | head -15
sed -n '/Host-bound decode/,/One step/p' $OUT/bench-cc/cc.md
echo "== fuzzer (t=${SECONDS}s)"
FUZZ_S=$(( $(left) > 120 ? $(left) - 85 : 20 ))
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$FUZZ_S \
  timeout -k 5 $(slot $((FUZZ_S + 15))) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
grep -iE "cc fuzz: programs" $OUT/fuzz-default.log | tail -2; tail -1 $OUT/fuzz-default.log
echo "== tests/gpu/syncs/test_syncs_compile_graph_breaks_gpu.py (t=${SECONDS}s)" > $OUT/gpu-syncs.log
timeout -k 5 $(slot 60) python3 -m pytest -q -rfE -p no:cacheprovider --timeout 120 \
  tests/gpu/syncs/test_syncs_compile_graph_breaks_gpu.py >> $OUT/gpu-syncs.log 2>&1
tail -1 $OUT/gpu-syncs.log
if [ "$(left)" -gt 20 ]; then
  timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_hostbound.py --untimed --launches 8 --steps 300 --rounds 15 \
    --setups plain,floor,emulated,emulated+shim > $OUT/gpu-paced.log 2>&1
  tail -5 $OUT/gpu-paced.log
fi
echo "== end (t=${SECONDS}s)"

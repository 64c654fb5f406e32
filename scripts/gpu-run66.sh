#!/usr/bin/env bash
# Session 2026-12-03 (20), fourth call, the final code: each bench loop on a D2H stream of its own; tests/gpu/cc (without the fuzzer, which run 64 ran on the same
# shim code) and bench cc with its GPU-paced loop beside the host-bound one.
set -u
LIMIT=${LIMIT:-400}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 110
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 200) python3 -m syncless bench cc --out $OUT/bench-cc >> $OUT/bench-cc.log 2>&1
rm -f $OUT/bench-cc/report.md $OUT/bench-cc/cc.png
grep -E "goal|readback|1 MiB" $OUT/bench-cc.log | head -30
sed -n '/Host-bound decode/,/One step/p' $OUT/bench-cc/cc.md
echo "== end (t=${SECONDS}s)"

#!/usr/bin/env bash
# Session 2026-12-03 (18), second call: the per-step copies with fewer Python calls (the emulator's wait in one call,
# the lane's helpers inlined). Calls per line of the host-bound loop, call counts, the bench's loop untimed,
# bench cc, tests/gpu/cc.
set -u
LIMIT=${LIMIT:-330}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_hostbound.py --calls --setups plain,floor,emulated+shim > $OUT/calls.log 2>&1
tail -4 $OUT/calls.log
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_call_counts.py --repeats 300 --names > $OUT/counts.log 2>&1
head -16 $OUT/counts.log
timeout -k 5 $(slot 50) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 400 --rounds 5 \
  --setups plain,floor,emulated,emulated+shim >> $OUT/diag.log 2>&1
tail -5 $OUT/diag.log
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 70) python3 -m syncless bench cc --out $OUT/bench-cc >> $OUT/bench-cc.log 2>&1
grep -E "goal|readback|1 MiB" $OUT/bench-cc.log | head -30
cc_suites $OUT/gpu-cc.log 70
echo "== end (t=${SECONDS}s)"

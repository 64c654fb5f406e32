#!/usr/bin/env bash
# Session 2026-12-03 (19), first call: the read at the call as two driver calls after the look (its result and
# context check made before it), the review's word-write fixes; tests/gpu/cc, call counts with where the helper
# path's host time goes (cProfile), and the bench's loop with the helper side by side.
set -u
LIMIT=${LIMIT:-330}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 90
timeout -k 5 $(slot 60) python3 tests/gpu/cc/probe_call_counts.py --repeats 300 --names --profile 300 > $OUT/counts.log 2>&1
head -18 $OUT/counts.log
timeout -k 5 $(slot 90) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 400 --rounds 6 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+helper >> $OUT/diag.log 2>&1
tail -6 $OUT/diag.log
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_hostbound.py --calls --setups emulated+shim,emulated+shim+helper \
  > $OUT/calls.log 2>&1
grep -E "per step in all" $OUT/calls.log
echo "== end (t=${SECONDS}s)"

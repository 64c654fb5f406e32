#!/usr/bin/env bash
# Session 2026-12-03 (17), first call: where the host-bound step goes under each readback policy (read now, offloaded
# and run by the waiter, offloaded and run by the queue's thread) with the job's one GIL hand-off, against a floor
# (plain torch plus the transfer wait alone); the lane's pieces; call counts; the ordering suites as a check.
set -u
LIMIT=${LIMIT:-300}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 $(slot 90) python3 tests/gpu/cc/probe_hostbound.py --steps 300 --rounds 4 --profile \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+offload,emulated+shim+eager,emulated+shim+readnow >> $OUT/diag.log 2>&1
grep -B2 -A12 "^phase" $OUT/diag.log
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_lane_parts.py --repeats 1000 > $OUT/lane.log 2>&1
cat $OUT/lane.log
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_call_counts.py --repeats 300 > $OUT/counts.log 2>&1
tail -14 $OUT/counts.log
echo "== ordering suites (t=${SECONDS}s)" > $OUT/gpu-cc.log
timeout -k 5 $(slot 100) python3 -m pytest -q -rfE -p no:cacheprovider --timeout 60 tests/gpu/cc/test_cc_d2h_ordering.py \
  tests/gpu/cc/test_cc_sync.py tests/gpu/cc/test_cc_review33.py tests/gpu/cc/test_cc_any_event.py >> $OUT/gpu-cc.log 2>&1
tail -5 $OUT/gpu-cc.log
echo "== end (t=${SECONDS}s)"

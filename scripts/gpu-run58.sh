#!/usr/bin/env bash
# Session 2026-12-03 (18), third call (diagnostic): where a 1 MiB H2D behind 20 ms spends its host time on the
# staged path; the lane's pieces after the trims (and the driver's own cost per call); the bench's loop untimed.
set -u
LIMIT=${LIMIT:-200}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_h2d_breakdown.py --calls 60 --queued-ms 20 > $OUT/breakdown.log 2>&1
cat $OUT/breakdown.log
timeout -k 5 $(slot 60) python3 tests/gpu/cc/probe_lane_parts.py --repeats 1000 > $OUT/lane.log 2>&1
cat $OUT/lane.log
timeout -k 5 $(slot 50) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 400 --rounds 5 \
  --setups plain,floor,emulated,emulated+shim >> $OUT/diag.log 2>&1
tail -5 $OUT/diag.log
echo "== end (t=${SECONDS}s)"

#!/usr/bin/env bash
# Session 2026-12-03 (20), fifth call, diagnosis: the GPU-paced loop (8 eager launches a step) per phase, the shim
# with its chosen way, the look alone and the offload alone.
set -u
LIMIT=${LIMIT:-150}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 $(slot 70) python3 tests/gpu/cc/probe_hostbound.py --launches 8 --steps 300 --rounds 5 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+look,emulated+shim+offload > $OUT/phases.log 2>&1
grep "round 5" $OUT/phases.log; sed -n '/phase (median/,/^step/p' $OUT/phases.log
echo "== end (t=${SECONDS}s)"

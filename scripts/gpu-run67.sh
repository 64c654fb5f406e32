#!/usr/bin/env bash
# Session 2026-12-04 (21), first call, diagnosis: do syncless's private copy streams wait behind unrelated compute
# (a shared hardware queue)? Then the GPU-paced loop (8 eager launches a step) per phase, each way pinned.
set -u
LIMIT=${LIMIT:-170}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 $(slot 30) python3 tests/gpu/cc/probe_false_dependency.py > $OUT/false-dep.log 2>&1
cat $OUT/false-dep.log
timeout -k 5 $(slot 70) python3 tests/gpu/cc/probe_hostbound.py --launches 8 --steps 300 --rounds 4 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+look,emulated+shim+offload > $OUT/phases.log 2>&1
grep "round 4" $OUT/phases.log; sed -n '/phase (median/,/^step/p' $OUT/phases.log
echo "== end (t=${SECONDS}s)"

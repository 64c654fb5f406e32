#!/usr/bin/env bash
# Session 2026-12-03 (20), first call, diagnosis: the readback offloaded and run by the thread that waits for it
# (+offload) against the read at the call, now that both are raw driver calls: phases, calls per line, a profile,
# and 15 rotated untimed rounds.
set -u
LIMIT=${LIMIT:-330}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
S=plain,floor,emulated,emulated+shim,emulated+shim+offload
timeout -k 5 $(slot 80) python3 tests/gpu/cc/probe_hostbound.py --steps 300 --rounds 5 --setups $S \
  --profile --profile-setup emulated+shim+offload > $OUT/phases.log 2>&1
sed -n '/phase (median/,/^step/p' $OUT/phases.log
timeout -k 5 $(slot 60) python3 tests/gpu/cc/probe_hostbound.py --calls --setups emulated+shim,emulated+shim+offload \
  > $OUT/calls.log 2>&1
grep "per step in all" $OUT/calls.log
timeout -k 5 $(slot 100) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 300 --rounds 15 --setups $S \
  >> $OUT/diag.log 2>&1
tail -6 $OUT/diag.log
echo "== end (t=${SECONDS}s)"

#!/usr/bin/env bash
# Session 23 (2026-12-04), a diagnostic: what the readback's trials see in the host-bound loop. The timed probe
# with each way pinned (the step's median against its mean and tail, per round), and the bench's own loop untimed
# with the trial's medians and means per way after each round.
set -u
LIMIT=${LIMIT:-150}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
P=tests/gpu/cc/probe_hostbound.py
echo "== host-bound, timed (t=${SECONDS}s)" | tee $OUT/hostbound-timed.log
timeout -k 5 $(slot 50) python3 $P --steps 300 --rounds 5 \
  --setups plain,emulated+shim+look,emulated+shim+offload,emulated+shim >> $OUT/hostbound-timed.log 2>&1
grep -E "round|Error" $OUT/hostbound-timed.log; sed -n '/phase (median/,/^step/p' $OUT/hostbound-timed.log
echo "== host-bound, untimed (t=${SECONDS}s)" | tee $OUT/hostbound-untimed.log
timeout -k 5 $(slot 60) python3 $P --untimed --steps 300 --rounds 10 \
  --setups plain,emulated,emulated+shim,emulated+shim+look,emulated+shim+offload >> $OUT/hostbound-untimed.log 2>&1
grep -E "emulated\+shim |median|Error|error" $OUT/hostbound-untimed.log
echo "== end (t=${SECONDS}s)"

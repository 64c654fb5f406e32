#!/usr/bin/env bash
# Session 23 (2026-12-04), a diagnostic: why the bench's GPU-paced loop runs the shim at ~0.92x plain (a steady
# ~29 us a step more) while the timed probe's median step matches plain. Untimed loops (the bench's own) per
# setup with one thing changed each (the word write off, the upload staged, the collector off, offloaded), and
# the timed probe with the step's mean, tail and Python's collections per round.
set -u
LIMIT=${LIMIT:-200}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
P=tests/gpu/cc/probe_hostbound.py
echo "== GPU-paced, untimed (t=${SECONDS}s)" | tee $OUT/paced-untimed.log
timeout -k 5 $(slot 70) python3 $P --untimed --launches 8 --steps 300 --rounds 6 \
  --setups plain,emulated,emulated+shim,emulated+shim+nowords,emulated+shim+noinline,emulated+shim+nogc,emulated+shim+offload,plain+nogc \
  >> $OUT/paced-untimed.log 2>&1
grep -E "median|Error|error" $OUT/paced-untimed.log
echo "== GPU-paced, timed (t=${SECONDS}s)" | tee $OUT/paced-timed.log
timeout -k 5 $(slot 50) python3 $P --launches 8 --steps 300 --rounds 4 \
  --setups plain,emulated+shim,emulated+shim+nowords,emulated+shim+nogc >> $OUT/paced-timed.log 2>&1
grep -E "round|Error" $OUT/paced-timed.log; sed -n '/phase (median/,/^step/p' $OUT/paced-timed.log
echo "== host-bound, untimed (t=${SECONDS}s)" | tee $OUT/hostbound-untimed.log
timeout -k 5 $(slot 60) python3 $P --untimed --steps 300 --rounds 6 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+nowords,emulated+shim+nogc,emulated+shim+look,emulated+shim+offload \
  >> $OUT/hostbound-untimed.log 2>&1
grep -E "median|Error|error" $OUT/hostbound-untimed.log
echo "== end (t=${SECONDS}s)"

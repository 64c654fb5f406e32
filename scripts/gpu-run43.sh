#!/usr/bin/env bash
# Session 2026-12-03 (15), first call: the host-bound loop per phase, with a cProfile of the shim's loop.
set -u
LIMIT=${LIMIT:-200}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 $(slot 60) python3 tests/gpu/cc/probe_helper.py > $OUT/helper.log 2>&1; echo "rc $?" >> $OUT/helper.log
cat $OUT/helper.log
timeout -k 5 $(slot 150) python3 tests/gpu/cc/probe_hostbound.py --steps 300 --rounds 2 --profile >> $OUT/diag.log 2>&1
cat $OUT/diag.log

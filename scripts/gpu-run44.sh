#!/usr/bin/env bash
# Session 2026-12-03 (15), second call: the D2H helper process: probe, GPU tests, the host-bound loop with it.
set -u
LIMIT=${LIMIT:-300}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_helper.py > $OUT/helper.log 2>&1; echo "rc $?" >> $OUT/helper.log
cat $OUT/helper.log
timeout -k 5 $(slot 120) python3 -m pytest -q --timeout 100 tests/gpu/cc/test_cc_helper.py > $OUT/gpu-helper.log 2>&1
tail -30 $OUT/gpu-helper.log
timeout -k 5 $(slot 150) python3 tests/gpu/cc/probe_hostbound.py --steps 300 --rounds 3 --profile >> $OUT/diag.log 2>&1
cat $OUT/diag.log

#!/usr/bin/env bash
# Session 2026-12-02 (14), last call: where a one-element upload's host time goes (leads for issue 33).
set -u
LIMIT=${LIMIT:-90}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 $(slot 60) python3 tests/gpu/cc/probe_small_upload.py --repeats 2000 >> $OUT/diag.log 2>&1
cat $OUT/diag.log

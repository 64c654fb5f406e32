#!/usr/bin/env bash
# Session 2026-12-03 (15), last call: the helper's GPU tests with item 7 across processes, and the issue-33 file.
set -u
LIMIT=${LIMIT:-150}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
timeout -k 5 $(slot 120) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 100 tests/gpu/cc/test_cc_helper.py \
  tests/gpu/cc/test_cc_review33.py > $OUT/gpu-cc.log 2>&1
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" $OUT/gpu-cc.log | tail -25

#!/usr/bin/env bash
# Session 2026-12-03 (15), after the read-through: the offload's shared submit step and the slimmer helper job.
set -u
LIMIT=${LIMIT:-75}
source "$(dirname "$0")/gpu-common.sh"
timeout -k 5 $(slot 70) python3 -m pytest -q -rfE -p no:cacheprovider --timeout 60 tests/gpu/cc/test_cc_helper.py \
  tests/gpu/cc/test_cc_review33.py tests/gpu/cc/test_cc_d2h_ordering.py > $OUT/gpu-cc.log 2>&1
tail -6 $OUT/gpu-cc.log

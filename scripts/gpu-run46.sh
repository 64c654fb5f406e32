#!/usr/bin/env bash
# Session 2026-12-03 (15), fourth call: the helper's waiter spinning before it sleeps: its GPU tests and bench cc.
set -u
LIMIT=${LIMIT:-200}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
echo "== tests/gpu/cc/test_cc_helper.py (t=${SECONDS}s)" > $OUT/gpu-cc.log
timeout -k 5 $(slot 60) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 50 tests/gpu/cc/test_cc_helper.py >> $OUT/gpu-cc.log 2>&1
timeout -k 5 $(slot 30) python3 tests/gpu/cc/probe_helper.py >> $OUT/diag.log 2>&1
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 80) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
tar czf $OUT/bench-cc.tgz -C /tmp bench-cc
grep -E "goal|host-bound round|readback" $OUT/bench-cc.log | head -30
grep -E "passed|failed|SKIPPED" $OUT/gpu-cc.log; cat $OUT/diag.log

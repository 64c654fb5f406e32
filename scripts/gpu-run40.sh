#!/usr/bin/env bash
# Session 2026-12-02 (14), fourth call: after the review of the inline uploads (nested tensors, forward-mode
# tangents, a failed launch's fallback): the cc files they touch, and the fuzzer at 4,000 programs.
set -u
LIMIT=${LIMIT:-240}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
echo "== cc files (t=${SECONDS}s)" > $OUT/gpu-cc.log
timeout -k 5 $(slot 100) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 60 tests/gpu/cc/test_cc_inline_h2d.py \
  tests/gpu/cc/test_cc_sync.py tests/gpu/cc/test_cc_review33.py tests/gpu/cc/test_cc_signatures_gpu.py >> $OUT/gpu-cc.log 2>&1
echo "== the fuzzer, 4,000 programs (t=${SECONDS}s)" >> $OUT/gpu-cc.log
SYNCLESS_FUZZ_PROGRAMS=4000 SYNCLESS_FUZZ_TIME_S=70 timeout -k 5 $(slot 100) python3 -m pytest -v -s -rfE \
  -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz.log 2>&1
tail -12 $OUT/fuzz.log >> $OUT/gpu-cc.log
grep -E "^== |^FAILED|^ERROR| passed| failed|programs" $OUT/gpu-cc.log | tail -20

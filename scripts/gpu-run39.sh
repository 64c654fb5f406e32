#!/usr/bin/env bash
# Session 2026-12-02 (14), third call: the GPU files fixed after run 38 (randomized copies, vLLM compat, the
# transformers example), bench syncs with room to finish, bench cc and the host-bound probe again.
set -u
LIMIT=${LIMIT:-400}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
for f in tests/gpu/cc/test_cc_randomized.py tests/gpu/compat/test_vllm_compat_gpu.py tests/gpu/test_example_transformers.py; do
  echo "== $f (t=${SECONDS}s)" >> $OUT/suites.log
  timeout -k 5 $(slot 60) python3 -m pytest -v -rfE -p no:cacheprovider --timeout 55 "$f" >> $OUT/suites.log 2>&1
  echo "== rc=$? t=${SECONDS}s" >> $OUT/suites.log
done
echo "== bench syncs (t=${SECONDS}s)" > $OUT/bench-syncs.log
timeout -k 5 $(slot 150) python3 -m syncless bench syncs --out /tmp/bench-syncs >> $OUT/bench-syncs.log 2>&1
echo "== bench cc (t=${SECONDS}s)" > $OUT/bench-cc.log
timeout -k 5 $(slot 60) python3 -m syncless bench cc --out /tmp/bench-cc >> $OUT/bench-cc.log 2>&1
tar czf $OUT/bench.tgz -C /tmp bench-cc bench-syncs
timeout -k 5 $(slot 45) python3 tests/gpu/cc/probe_hostbound.py --steps 400 --rounds 3 >> $OUT/diag.log 2>&1
grep -E "^(round|phase|h2d|d2d|wait_stream|to_cpu|event|step|sync_prev)" $OUT/diag.log | head -30
grep -E "^== |^FAILED|^ERROR| passed| failed" $OUT/suites.log
grep -E "goal|wrote" $OUT/bench-cc.log | head
tail -8 $OUT/bench-syncs.log | cut -c1-300

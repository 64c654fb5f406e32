#!/usr/bin/env bash
# Session 2026-12-02 (13), first call: where the host-bound loop's time goes (issue 33), then the GPU suites owed
# by issues 34-36, file by file with -v and a timeout each, and bench syncs. Every step checks the time left.
set -u
LIMIT=${LIMIT:-570}
source "$(dirname "$0")/gpu-common.sh"
run_file() {  # log, seconds, pytest args...
  local log=$1 secs=$2; shift 2
  if [ "$(left)" -lt $((secs / 2)) ]; then echo "== SKIPPED (time) $*" >> "$OUT/$log"; return; fi
  [ "$secs" -gt "$(left)" ] && secs=$(left)
  echo "== $* (${secs}s, t=${SECONDS}s)" >> "$OUT/$log"
  timeout -k 5 "$secs" python3 -m pytest -v -rfE -p no:cacheprovider --timeout 100 "$@" >> "$OUT/$log" 2>&1
  echo "== rc=$? t=${SECONDS}s" >> "$OUT/$log"
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print(torch.__version__)"; } > $OUT/diag.log 2>&1
timeout -k 5 120 python3 tests/gpu/cc/probe_hostbound.py --steps 400 --rounds 3 --profile >> $OUT/diag.log 2>&1
timeout -k 5 60 python3 tests/gpu/cc/probe_call_counts.py --repeats 300 >> $OUT/diag.log 2>&1
mkdir -p /tmp/tl
export SYNCLESS_GPU_ARTIFACTS=/tmp/tl
for f in tests/gpu/syncs/test_timeline_gpu.py tests/gpu/syncs/test_syncs_compile_graph_breaks_gpu.py \
         tests/gpu/syncs/test_syncs_via_gpu.py tests/gpu/pp/test_received_step_streams_one_gpu.py; do
  run_file new.log 90 "$f"
done
unset SYNCLESS_GPU_ARTIFACTS
tar czf $OUT/timeline.tgz -C /tmp tl 2>/dev/null
for f in tests/gpu/syncs/test_*.py; do
  case $f in *timeline*|*graph_breaks*|*via_gpu*) continue;; esac
  run_file syncs.log 80 "$f"
done
for f in tests/gpu/pp/test_*.py tests/gpu/compat/test_*.py tests/gpu/test_*.py; do
  case $f in *received_step*) continue;; esac
  run_file other.log 90 "$f"
done
if [ "$(left)" -gt 60 ]; then
  timeout -k 5 $(left) python3 -m syncless bench syncs --out /tmp/bench-syncs > $OUT/bench-syncs.log 2>&1
  tar czf $OUT/bench-syncs.tgz -C /tmp bench-syncs
fi
for f in new syncs other; do echo "== $f"; grep -E "^== |^FAILED|^ERROR| passed| failed|SKIPPED" $OUT/$f.log | grep -v "^== rc" | tail -40; done

#!/usr/bin/env bash
# Written in session 2026-12-04 (21) for the next session's first call, at the final code of session 21: the GPU
# suites owed there (tests/gpu/cc, with test_cc_readback_choice.py at the final trial rule), bench cc (the host-bound
# loop on a D2H stream of its own, the new "host in d2h.wait_stream" column), and the GPU-paced loop per phase over
# 8 rounds (are a shim setup's first rounds slow, as in run 67?).
set -u
LIMIT=${LIMIT:-330}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 110
bench_cc $OUT/bench-cc.log 110
timeout -k 5 $(slot 80) python3 tests/gpu/cc/probe_hostbound.py --launches 8 --steps 300 --rounds 8 \
  --setups plain,floor,emulated,emulated+shim,emulated+shim+offload > $OUT/phases.log 2>&1
grep "round" $OUT/phases.log; sed -n '/phase (median/,/^step/p' $OUT/phases.log
echo "== end (t=${SECONDS}s)"

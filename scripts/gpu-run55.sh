#!/usr/bin/env bash
# Session 2026-12-03 (17), fifth call, after the review: the job's wait for its ready event back on the host, its copy
# holding the GIL only under emulation where NVML says CC is off, a job run again after its copy makes nothing
# twice, the look ends at a capture. tests/gpu/cc, the fuzzer (time-limited), the bench's loop untimed.
set -u
LIMIT=${LIMIT:-210}
source "$(dirname "$0")/gpu-common.sh"
diag_header $OUT/diag.log
cc_suites $OUT/gpu-cc.log 90
timeout -k 5 $(slot 40) python3 tests/gpu/cc/probe_hostbound.py --untimed --steps 400 --rounds 5 \
  --setups plain,floor,emulated,emulated+shim >> $OUT/diag.log 2>&1
tail -5 $OUT/diag.log
SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$(( $(left) > 40 ? $(left) - 20 : 10 )) \
  timeout -k 5 $(slot 200) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > $OUT/fuzz-default.log 2>&1
tail -3 $OUT/fuzz-default.log
echo "== end (t=${SECONDS}s)"

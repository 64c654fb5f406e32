#!/usr/bin/env bash
# Session 2026-12-02 (13), second call: issue 33 after the fast lane and the worker's wake fix: the probes (phases of
# the host-bound loop, call counts), tests/gpu/cc with the fuzzer at 4,000 programs, and bench cc.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD/src:$PWD/tests:/tmp/site" SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout -k 5 100 python3 tests/gpu/cc/probe_hostbound.py --steps 400 --rounds 3 --profile > $OUT/diag.log 2>&1
timeout -k 5 60 python3 tests/gpu/cc/probe_call_counts.py --repeats 300 >> $OUT/diag.log 2>&1
SYNCLESS_FUZZ_PROGRAMS=4000 timeout -k 5 200 python3 -m pytest -v -rfE -p no:cacheprovider --timeout 150 tests/gpu/cc > $OUT/gpu-cc.log 2>&1
timeout -k 5 150 python3 -m syncless bench cc --out $OUT/bench-cc > $OUT/bench-cc.log 2>&1
grep -E "^(round|phase|h2d|d2d|replay|launches|wait_stream|to_cpu|event|sync_prev|int|step|shim:|plain:|per-step|1 MiB)" $OUT/diag.log
grep -E "^FAILED|^ERROR| passed| failed" $OUT/gpu-cc.log | tail -15
grep -E "host-bound|readback|1 MiB|goal" $OUT/bench-cc.log

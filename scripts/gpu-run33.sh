#!/usr/bin/env bash
# Session 2026-12-02: issue 33's GPU run (one H200). Logs under $OUT.
set -u
export PYTHONPATH="$PWD/src:$PWD/tests" SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/machine.txt
python3 -c "import torch; print(torch.__version__)" >> $OUT/machine.txt
timeout 60 python3 tests/gpu/cc/probe_call_counts.py --src src --label new --repeats 300 > $OUT/calls-new.log 2>&1
timeout 60 python3 tests/gpu/cc/probe_call_counts.py --src old_tree/src --label old-71f17b8 --repeats 300 > $OUT/calls-old.log 2>&1
cat $OUT/calls-new.log $OUT/calls-old.log | grep -v "^$"
SYNCLESS_FUZZ_PROGRAMS=4000 timeout 300 python3 -m pytest -q -x tests/gpu/cc -p no:cacheprovider --timeout 200 > $OUT/gpu-cc.log 2>&1
tail -15 $OUT/gpu-cc.log
timeout 200 python3 -m syncless bench cc --out $OUT/bench-cc > $OUT/bench-cc.log 2>&1
tail -30 $OUT/bench-cc.log

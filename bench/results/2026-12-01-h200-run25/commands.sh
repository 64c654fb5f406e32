#!/usr/bin/env bash
# Run 25: after the review commits: tests/gpu/cc and tests/gpu/syncs side by side, a 2,000-program fuzzer check.
set -u
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u > $L/date.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -rfEs -p no:cacheprovider -p no:randomly --timeout-method=thread"
( SYNCLESS_FUZZ_SEED=20261500 SYNCLESS_FUZZ_PROGRAMS=2000 SYNCLESS_FUZZ_TIME_S=150 \
  timeout -k 5 200 $P -s tests/gpu/cc/test_cc_fuzz.py --timeout 195 > $L/cc-fuzz.log 2>&1; echo "exit $?" >> $L/cc-fuzz.log ) &
( timeout -k 5 300 $P -v tests/gpu/syncs tests/gpu/compat --timeout 150 > $L/gpu-syncs.log 2>&1; echo "exit $?" >> $L/gpu-syncs.log ) &
timeout -k 5 300 $P -v tests/gpu/cc --timeout 150 --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz \
  > $L/gpu-cc.log 2>&1; echo "gpu-cc rc $?: $(tail -1 $L/gpu-cc.log)"
wait
echo "gpu-syncs: $(tail -2 $L/gpu-syncs.log | tr '\n' ' ')"
grep -E "^(FAILED|ERROR)" $L/gpu-cc.log $L/gpu-syncs.log | head -30
grep -E "^cc fuzz: programs|^exit" $L/cc-fuzz.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs

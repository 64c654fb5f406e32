#!/usr/bin/env bash
# One-GPU suites at the final code (CUPTI carried), and beside them the CPU suites on the CUDA build (xdist).
set -u
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u > $L/date.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -rfEs -p no:cacheprovider -p no:randomly --timeout-method=thread"
( timeout -k 5 ${UNIT_S:-400} $P -q -n 6 tests/unit --timeout 200 > $L/unit-cuda-build.log 2>&1; echo "exit $?" >> $L/unit-cuda-build.log ) &
timeout -k 5 ${SUITE_S:-420} $P -v tests/gpu tests/plugin -m "not multi_gpu" --timeout 150 \
  --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz --deselect tests/gpu/pp/test_deferred_wait_one_gpu.py \
  > $L/gpu-one.log 2>&1; echo "gpu-one rc $?: $(tail -1 $L/gpu-one.log)"
grep -E "^(FAILED|ERROR)" $L/gpu-one.log | head -40
wait; echo "unit (CUDA build): $(tail -2 $L/unit-cuda-build.log | tr '\n' ' ')"; grep -E "^(FAILED|ERROR)" $L/unit-cuda-build.log | head -20
cd $OUT && tar czf logs.tgz logs && rm -rf logs

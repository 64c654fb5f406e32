#!/usr/bin/env bash
# Run 23: after the compiled-sites test and the CUDA-build unit fixes: the syncs compiled tests, tests/gpu/cc,
# the demo's GPU tests, a 4,000-program fuzzer check; tests/unit on the CUDA build beside them.
set -u
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u > $L/date.txt; git log -1 --format='%H %s' >> $L/date.txt 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -rfEs -p no:cacheprovider -p no:randomly --timeout-method=thread"
( timeout -k 5 330 $P -q -n 8 --tb=short tests/unit --timeout 200 > $L/unit-cuda-build.log 2>&1; echo "exit $?" >> $L/unit-cuda-build.log ) &
( SYNCLESS_FUZZ_SEED=20261400 SYNCLESS_FUZZ_PROGRAMS=4000 SYNCLESS_FUZZ_TIME_S=200 \
  timeout -k 5 240 $P -s tests/gpu/cc/test_cc_fuzz.py --timeout 235 > $L/cc-fuzz.log 2>&1; echo "exit $?" >> $L/cc-fuzz.log ) &
timeout -k 5 400 $P -v tests/gpu/syncs/test_syncs_compiled_sites_gpu.py tests/gpu/syncs/test_compiled_decode_gpu.py \
  tests/gpu/cc tests/gpu/test_demo_gpu.py --timeout 150 --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz \
  > $L/gpu.log 2>&1; echo "gpu rc $?: $(tail -1 $L/gpu.log)"
grep -E "^(FAILED|ERROR)" $L/gpu.log | head -40
wait
grep -E "^cc fuzz: programs|^exit" $L/cc-fuzz.log
echo "unit (CUDA build): $(tail -2 $L/unit-cuda-build.log | tr '\n' ' ')"; grep -E "^(FAILED|ERROR)" $L/unit-cuda-build.log | head -30
cd $OUT && tar czf logs.tgz logs && rm -rf logs

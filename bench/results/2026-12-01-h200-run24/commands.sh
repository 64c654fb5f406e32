#!/usr/bin/env bash
# Run 24: the syncs GPU suites and the plugin at the final code (after the shared first-only fix), with
# tests/unit/syncs on the CUDA build beside them.
set -u
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u > $L/date.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/asy .whl/asyncio/*.whl && echo "asyncio wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -rfEs -p no:cacheprovider -p no:randomly --timeout-method=thread"
( timeout -k 5 300 $P -q -n 6 --tb=short tests/unit/syncs tests/unit/compat --timeout 200 > $L/unit-syncs-cuda-build.log 2>&1; echo "exit $?" >> $L/unit-syncs-cuda-build.log ) &
timeout -k 5 330 $P -v tests/gpu/syncs tests/gpu/compat --timeout 150 > $L/gpu-syncs.log 2>&1; echo "gpu-syncs rc $?: $(tail -1 $L/gpu-syncs.log)"
grep -E "^(FAILED|ERROR)" $L/gpu-syncs.log | head -30
PYTHONPATH=/tmp/asy:$PYTHONPATH timeout -k 5 150 $P -v tests/plugin --timeout 100 > $L/plugin.log 2>&1; echo "plugin rc $?: $(tail -1 $L/plugin.log)"
grep -E "^(FAILED|ERROR|SKIPPED)" $L/plugin.log
wait; echo "unit syncs+compat (CUDA build): $(tail -2 $L/unit-syncs-cuda-build.log | tr '\n' ' ')"; grep -E "^(FAILED|ERROR)" $L/unit-syncs-cuda-build.log | head -20
cd $OUT && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Run 22 (part 2): the compiled-item stack probe, the plugin suite (pytest-asyncio carried), tests/unit on the
# CUDA build beside them; then bench cc alone.
set -u
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u > $L/date2.txt; git log -1 --format='%H %s' >> $L/date2.txt 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/asy .whl/asyncio/*.whl && echo "asyncio wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -rfEs -p no:cacheprovider -p no:randomly --timeout-method=thread"
( timeout -k 5 300 $P -q -n 8 --tb=short tests/unit --timeout 200 > $L/unit-cuda-build.log 2>&1; echo "exit $?" >> $L/unit-cuda-build.log ) &
timeout -k 5 120 python3 tests/gpu/syncs/probe_compiled_item_stack.py > $L/probe-item-stack.log 2>&1; echo "probe rc $?"
cat $L/probe-item-stack.log | head -80
PYTHONPATH=/tmp/asy:$PYTHONPATH timeout -k 5 150 $P -v tests/plugin --timeout 100 > $L/plugin.log 2>&1; echo "plugin rc $?: $(tail -1 $L/plugin.log)"
grep -E "^(FAILED|ERROR|SKIPPED)" $L/plugin.log
wait; echo "unit (CUDA build): $(tail -2 $L/unit-cuda-build.log | tr '\n' ' ')"; grep -E "^(FAILED|ERROR)" $L/unit-cuda-build.log | head -30
PYTHONPATH=$PWD/src timeout -k 5 120 python3 -m syncless bench cc --out $L/bench-cc > $L/bench-cc.log 2>&1; echo "bench-cc rc $?"
tail -25 $L/bench-cc.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs

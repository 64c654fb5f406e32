export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -v -rfEs -p no:cacheprovider --timeout-method=thread"
timeout -k 5 240 $P tests/plugin tests/gpu/pp -m "not multi_gpu" --timeout 150 > $L/gpu-plugin-pp.log 2>&1; echo "plugin+pp exit $?: $(tail -1 $L/gpu-plugin-pp.log)"
grep -E "FAILED|ERROR" $L/gpu-plugin-pp.log | head
cd $OUT && tar czf logs.tgz logs && rm -rf logs

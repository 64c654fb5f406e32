export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u
for i in 1 2 3 4 5 6; do
  PYTHONPATH=.base/src timeout 60 python3 .probe/ab.py base 2>&1 | tail -1 | tee -a $L/ab.log
  PYTHONPATH=src timeout 60 python3 .probe/ab.py new 2>&1 | tail -1 | tee -a $L/ab.log
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
timeout -k 5 240 python3 -m pytest -v -rfEs -p no:cacheprovider --timeout-method=thread tests/plugin --timeout 150 > $L/gpu-plugin.log 2>&1; echo "plugin exit $?: $(tail -1 $L/gpu-plugin.log)"
grep -E "FAILED|ERROR" $L/gpu-plugin.log | head
cd $OUT && tar czf logs.tgz logs && rm -rf logs

# Final check of the review fixes: cc + syncs suites beside the fuzzer, then bench cc.
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -v -rfEs -p no:cacheprovider --timeout-method=thread"
( SYNCLESS_FUZZ_TIME_S=100 timeout -k 5 130 $P -s tests/gpu/cc/test_cc_fuzz.py --timeout 125 > $L/cc-fuzz.log 2>&1; echo "exit $?" >> $L/cc-fuzz.log ) &
timeout -k 5 200 $P tests/gpu/cc tests/gpu/syncs --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz --timeout 120 > $L/gpu-cc-syncs.log 2>&1; echo "gpu-cc-syncs exit $?: $(tail -1 $L/gpu-cc-syncs.log)"
wait
grep -E "^cc fuzz: programs|^exit" $L/cc-fuzz.log | head
grep -E "FAILED|ERROR" $L/gpu-cc-syncs.log | head -20
PYTHONPATH=$PWD/src timeout -k 5 150 python3 -m syncless bench cc --out $OUT/bench-cc > $L/bench-cc.log 2>&1; echo "bench-cc exit $?"
grep -A10 "us to return" $OUT/bench-cc/cc.md | head -10; grep -A8 "^\*\*Goals" $OUT/bench-cc/cc.md
cd $OUT && tar czf logs.tgz logs && rm -rf logs

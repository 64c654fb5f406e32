# Final one-GPU call: probes on a quiet GPU, then every one-GPU suite beside the cc fuzzer, then bench cc.
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
PYTHONPATH=src timeout 120 python3 tests/gpu/cc/probe_h2d_host_state.py > $L/probe-host-state.log 2>&1; echo "host-state rc=$?"; cat $L/probe-host-state.log
for i in 1 2; do
  for v in base new; do
    if [ $v = base ]; then SP=.base/src; else SP=src; fi
    PYTHONPATH=$SP timeout 100 python3 tests/gpu/cc/probe_h2d_cost.py --repeats 41 > $L/probe-cost-$v-$i.log 2>&1; echo "cost $v $i rc=$?"
    grep -E "^plain|^shim|^emulated" $L/probe-cost-$v-$i.log
  done
done
PYTHONPATH=src timeout 100 python3 tests/gpu/cc/probe_h2d_breakdown.py --calls 200 > $L/probe-breakdown.log 2>&1; echo "bd rc=$?"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -v -rfEs -p no:cacheprovider --timeout-method=thread"
( SYNCLESS_FUZZ_TIME_S=150 timeout -k 5 185 $P -s tests/gpu/cc/test_cc_fuzz.py --timeout 180 > $L/cc-fuzz.log 2>&1; echo "exit $?" >> $L/cc-fuzz.log ) &
timeout -k 5 280 $P tests/gpu tests/plugin -m "not multi_gpu" --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz --timeout 150 > $L/gpu-one.log 2>&1; echo "gpu-one exit $?: $(tail -1 $L/gpu-one.log)"
wait
grep -E "^cc fuzz: programs|^exit" $L/cc-fuzz.log | head
grep -E "FAILED|ERROR" $L/gpu-one.log | head -20
PYTHONPATH=$PWD/src timeout -k 5 120 python3 -m syncless bench cc --out $OUT/bench-cc > $L/bench-cc.log 2>&1; echo "bench-cc exit $?"
grep -A10 "us to return" $OUT/bench-cc/cc.md | head -10; grep -A8 "^\*\*Goals" $OUT/bench-cc/cc.md
PYTHONPATH=$PWD/src python3 -m syncless doctor > $L/doctor.txt 2>&1
cd $OUT && tar czf logs.tgz logs && rm -rf logs

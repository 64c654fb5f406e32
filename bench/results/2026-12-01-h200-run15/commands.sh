# Probes first (quiet GPU), then cc + syncs suites beside the fuzzer, then bench cc. Hard limits on each.
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
git rev-parse --short HEAD 2>/dev/null; date -u
PYTHONPATH=src timeout 120 python3 tests/gpu/cc/probe_h2d_host_state.py > $OUT/probe-host-state.log 2>&1; echo "host-state rc=$?"; cat $OUT/probe-host-state.log
for i in 1 2; do
  for v in base new; do
    if [ $v = base ]; then SP=.base/src; else SP=src; fi
    PYTHONPATH=$SP timeout 100 python3 tests/gpu/cc/probe_h2d_cost.py --repeats 41 > $OUT/cost-$v-$i.log 2>&1; echo "cost $v $i rc=$?"
    grep -E "^plain|^shim|^emulated" $OUT/cost-$v-$i.log
  done
done
PYTHONPATH=src timeout 100 python3 tests/gpu/cc/probe_h2d_breakdown.py --calls 200 > $OUT/breakdown-idle.log 2>&1; echo "bd rc=$?"
head -30 $OUT/breakdown-idle.log
export PYTHONPATH=$PWD/src:$PWD/tests
P="python3 -m pytest -v -rfEs -p no:cacheprovider --timeout-method=thread"
( SYNCLESS_FUZZ_TIME_S=120 timeout -k 5 155 $P -s tests/gpu/cc/test_cc_fuzz.py --timeout 150 > $OUT/cc-fuzz.log 2>&1; echo "exit $?" >> $OUT/cc-fuzz.log ) &
timeout -k 5 150 $P tests/gpu/cc --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz --timeout 120 > $OUT/gpu-cc.log 2>&1; echo "gpu-cc exit $?: $(tail -1 $OUT/gpu-cc.log)"
wait
grep -E "^cc fuzz: programs|^exit|FAIL" $OUT/cc-fuzz.log | head
timeout -k 5 200 $P tests/gpu/syncs --timeout 120 > $OUT/gpu-syncs.log 2>&1; echo "gpu-syncs exit $?: $(tail -1 $OUT/gpu-syncs.log)"
grep -E "FAILED|ERROR" $OUT/gpu-cc.log $OUT/gpu-syncs.log | head -20
timeout -k 5 90 python3 -m syncless bench cc --out $OUT/bench-cc > $OUT/bench-cc.log 2>&1; echo "bench-cc exit $?"
grep -A8 "us to return" $OUT/bench-cc/cc.md | head -9

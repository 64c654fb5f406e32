#!/usr/bin/env bash
# One-GPU session run: every one-GPU suite (CUPTI carried) beside the cc fuzzer (two processes, 10,000
# programs each, both oracles), then alone: the pp deferred-wait measurement and bench cc.
set -u
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u > $L/date.txt; git log -1 --format='%H %s' >> $L/date.txt 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -rfEs -p no:cacheprovider -p no:randomly --timeout-method=thread"
python3 -m syncless doctor > $L/doctor.txt 2>&1; nvidia-smi -L >> $L/doctor.txt
for s in 1 2; do ( SYNCLESS_FUZZ_SEED=$((20261200 + s * 1000000)) SYNCLESS_FUZZ_PROGRAMS=10000 SYNCLESS_FUZZ_TIME_S=${FUZZ_S:-250} \
  timeout -k 5 290 $P -s tests/gpu/cc/test_cc_fuzz.py --timeout 285 > $L/cc-fuzz-$s.log 2>&1; echo "exit $?" >> $L/cc-fuzz-$s.log ) & done
timeout -k 5 ${SUITE_S:-330} $P -v tests/gpu tests/plugin -m "not multi_gpu" --timeout 150 \
  --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz --deselect tests/gpu/pp/test_deferred_wait_one_gpu.py \
  > $L/gpu-one.log 2>&1; echo "gpu-one rc $?: $(tail -1 $L/gpu-one.log)"
wait
for s in 1 2; do grep -E "^cc fuzz: (programs|time|oracle)|^exit" $L/cc-fuzz-$s.log; done
grep -E "^(FAILED|ERROR)" $L/gpu-one.log | head -40
timeout -k 5 100 $P -v -s tests/gpu/pp/test_deferred_wait_one_gpu.py --timeout 90 > $L/pp-deferred.log 2>&1; echo "pp-deferred rc $?"; grep -E "deferred-wait|passed|failed" $L/pp-deferred.log | tail -5
PYTHONPATH=$PWD/src timeout -k 5 ${BENCH_S:-130} python3 -m syncless bench cc --out $L/bench-cc > $L/bench-cc.log 2>&1; echo "bench-cc rc $?"
tail -30 $L/bench-cc.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs

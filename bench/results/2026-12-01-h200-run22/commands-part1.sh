#!/usr/bin/env bash
# Run 22 (part 1): every one-GPU suite (CUPTI carried) beside the cc fuzzer (two processes, 10,000 programs each,
# both oracles).
set -u
export SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L; date -u > $L/date.txt; git log -1 --format='%H %s' >> $L/date.txt 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && echo "cupti wheel installed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests SYNCLESS_REQUIRE_CUPTI=1
P="python3 -m pytest -rfEs -p no:cacheprovider -p no:randomly --timeout-method=thread"
python3 -m syncless doctor > $L/doctor.txt 2>&1; nvidia-smi -L >> $L/doctor.txt; python3 -m pytest --version >> $L/doctor.txt 2>&1
for s in 1 2; do ( SYNCLESS_FUZZ_SEED=$((20261300 + s * 1000000)) SYNCLESS_FUZZ_PROGRAMS=10000 SYNCLESS_FUZZ_TIME_S=${FUZZ_S:-300} \
  timeout -k 5 330 $P -s tests/gpu/cc/test_cc_fuzz.py --timeout 325 > $L/cc-fuzz-$s.log 2>&1; echo "exit $?" >> $L/cc-fuzz-$s.log ) & done
timeout -k 5 ${SUITE_S:-500} $P -v tests/gpu -m "not multi_gpu" --timeout 150 \
  --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz \
  > $L/gpu-one.log 2>&1; echo "gpu-one rc $?: $(tail -1 $L/gpu-one.log)"
wait
for s in 1 2; do grep -E "^cc fuzz: (programs|time|oracle)|^exit" $L/cc-fuzz-$s.log; done
grep -E "^(FAILED|ERROR)" $L/gpu-one.log | head -40
cd $OUT && tar czf logs.tgz logs && rm -rf logs

# Sourced by the scripts/gpu-run*.sh one-call scripts on the GPU machine: the carried wheels installed beside the source tree,
# the environment every GPU suite runs with, and time slots under a limit of LIMIT seconds for the whole call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD/src:$PWD/tests:/tmp/site" SYNCLESS_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 SYNCLESS_REQUIRE_CUPTI=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LIMIT=${LIMIT:-585}
left() { echo $((LIMIT - SECONDS)); }
slot() { local want=$1; local l; l=$(left); [ "$want" -gt "$l" ] && want=$l; echo "$want"; }
diag_header() {
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print(torch.__version__)"; date -u; } > "$1" 2>&1
}
# tests/gpu/cc without the fuzzer, appended to $1, within a slot of $2 seconds.
cc_suites() {
  echo "== tests/gpu/cc without the fuzzer (t=${SECONDS}s)" >> "$1"
  SYNCLESS_FUZZ_PROGRAMS=400 timeout -k 5 $(slot "$2") python3 -m pytest -q -rfE -p no:cacheprovider --timeout 60 tests/gpu/cc \
    --deselect tests/gpu/cc/test_cc_fuzz.py::test_differential_fuzz >> "$1" 2>&1
  tail -2 "$1"
}
# syncless bench cc into $1 (its log) and $1's folder bench-cc/, within a slot of $2 seconds; prints the goals and the
# batch-1 loops' tables.
bench_cc() {
  local log=$1 dir; dir=$(dirname "$1")/bench-cc
  echo "== bench cc (t=${SECONDS}s)" > "$log"
  timeout -k 5 $(slot "$2") python3 -m syncless bench cc --out "$dir" >> "$log" 2>&1
  rm -f "$dir/report.md" "$dir/cc.png"
  grep -E "goal|readback|1 MiB" "$log" | head -30
  sed -n '/Host-bound decode/,/One step/p' "$dir/cc.md"
}
# The differential fuzzer's 20,000 programs with both oracles, in what is left of the limit less 25 s, its log $1.
fuzz_cc() {
  echo "== fuzzer (t=${SECONDS}s)"
  local fuzz_s=$(( $(left) > 60 ? $(left) - 25 : 20 ))
  SYNCLESS_FUZZ_PROGRAMS=20000 SYNCLESS_FUZZ_TIME_S=$fuzz_s \
    timeout -k 5 $(slot $((fuzz_s + 15))) python3 -m pytest -q -s -rfE -p no:cacheprovider tests/gpu/cc/test_cc_fuzz.py > "$1" 2>&1
  grep -iE "cc fuzz: programs" "$1" | tail -2; tail -1 "$1"
}
# One pytest run as suite $1 within a slot of $2 seconds (the rest of the arguments go to pytest), its log $OUT/$1.log
# and one line in $OUT/summary.log. A script sets SUITE_FLAGS for its verbosity and timeouts.
SUITE_FLAGS=${SUITE_FLAGS:--q -rfEs --timeout 120}
run_suite() {
  local name=$1 want=$2; shift 2
  echo "== $name (t=${SECONDS}s)" | tee -a $OUT/summary.log
  # shellcheck disable=SC2086  # SUITE_FLAGS is a list of words
  timeout -k 5 $(slot "$want") python3 -m pytest $SUITE_FLAGS -p no:cacheprovider -m "not multi_gpu" "$@" \
    > $OUT/$name.log 2>&1
  echo "exit $?: $(tail -1 $OUT/$name.log)" | tee -a $OUT/summary.log
}

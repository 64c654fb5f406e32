"""The pp benchmark end to end on two GPUs: a tiny run measures every row with correct data (the harness's
correctness, not speed). Moved from tests/gpu/bench (it needs two GPUs; tests/gpu runs on one)."""

import math
import sys

import pytest

from syncless.bench._pp_launch import launch
from syncless.bench._pp_plan import KIB, MIB, Plan
from syncless.bench._pp_summary import build_output
from syncless.bench._report import write_output


def _tiny_plan() -> Plan:
    return Plan(
        quick=True,
        payloads=(64 * KIB, 8 * MIB),
        latency_payloads=(64 * KIB,),
        bandwidth_reps=1,
        bandwidth_min_steps=4,
        bandwidth_max_steps=8,
        warmup_steps=1,
        latency_iters=4,
        latency_reps=1,
        gemm_n=2048,
        gemm_window_ms=3.0,
        gemm_rounds=1,
        interference_nbytes=8 * MIB,
        spin_kernel_ms=0.5,
        spin_kernels_per_trial=1,
        spin_trials=1,
        pending_nbytes=8 * MIB,
        cpu_nbytes=8 * MIB,
        hard_timeout_s=240.0,
        idle_timeout_s=90.0,
    )


def _finite(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.multi_gpu(count=2)
@pytest.mark.timeout(300)
def test_tiny_benchmark_run_measures_everything_with_correct_data(tmp_path):
    plan = _tiny_plan()
    lines = []

    def progress(text):
        lines.append(text)
        print(f"[bench pp test] {text}", file=sys.stderr, flush=True)

    outcome = launch(plan, progress)
    assert outcome.complete, (outcome.failure, outcome.errors)
    results = outcome.results
    assert results["setup"]["rank0"]["transport_fwd"]["backend"] == "copy_engine", results["setup"]
    assert results["setup"]["rank0"]["transport_fwda"]["direct_unavailable_reason"] is None, results["setup"]
    for method in ("raw", "nccl", "ours", "ours_depth0", "ours_auto"):
        for nbytes in plan.payloads:
            record = results["bandwidth"][method][nbytes]
            assert _finite(record["gbps"]) and record["data_ok"] is True, (method, nbytes, record)
    for method in ("nccl", "ours"):
        for direction in ("send", "recv"):
            assert _finite(results["host_cpu"][method][8 * MIB][direction]["thread_us"])
    for base in ("nccl", "ours", "ours_depth0", "ours_auto", "raw_flags"):
        for method in (base, base + "@own"):  # on the default stream, and on a stream of each rank's own
            record = results["latency"][method][64 * KIB]
            assert _finite(record["one_way_us"]) and record["data_ok"] is True, (method, record)
    for mode in ("alone", "nccl", "ours"):
        assert _finite(results["gemm"][mode]["ms_per_gemm"]), results["gemm"]
    pending = results["pending"]
    assert pending["ctas_per_sm"] == 1
    for mode in ("nccl", "ours"):
        assert pending[mode]["pending"] is True and pending[mode]["data_ok"] is True, pending
        assert _finite(pending[mode]["kernel_ms"])
    output = build_output(plan, outcome)
    paths = write_output(output, tmp_path)
    assert paths["png"].stat().st_size > 10_000
    assert any("bandwidth 8 MiB" in line for line in lines)

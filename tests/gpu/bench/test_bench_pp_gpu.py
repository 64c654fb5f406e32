"""The pp benchmark's GPU machinery: the NVRTC full-SM kernel, the gate, the data pattern, and a
tiny end-to-end run on two GPUs (correctness of the harness, not speed)."""

import math
import sys

import pytest
import torch

from syncless.bench._pp_launch import launch
from syncless.bench._pp_plan import KIB, MIB, Plan
from syncless.bench._pp_summary import build_output
from syncless.bench._report import write_output


@pytest.mark.gpu
def test_pattern_is_identical_on_gpu_and_cpu(cuda_device):
    # The receiver regenerates what the sender sent and compares bit for bit;
    # that relies on the pattern being the same on every device.
    from syncless.bench._pp_rig import pattern

    on_gpu = pattern(3 << 20, 17, cuda_device)
    assert torch.equal(on_gpu.cpu(), pattern(3 << 20, 17, torch.device("cpu")))


@pytest.mark.gpu
def test_full_sm_kernel_fits_one_cta_per_sm_and_spins(cuda_device):
    from syncless._core.cuda import device_attribute
    from syncless.bench._pp_cuda import SpinKernel, bind_primary_context

    torch.empty(1, device=cuda_device)
    context = bind_primary_context(cuda_device.index)
    kernel = SpinKernel(cuda_device.index, torch.cuda.get_device_capability(cuda_device))
    try:
        assert kernel.ctas_per_sm == 1
        assert kernel.sm_count == device_attribute(cuda_device.index, "MULTIPROCESSOR_COUNT")
        stream = torch.cuda.Stream(device=cuda_device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            kernel.launch(4_000_000, stream)
            end.record()
        end.synchronize()
        # A physical lower bound, not a speed goal: no SM clock reaches 4 GHz,
        # so 4e6 cycles take at least 1 ms if the kernel really spun.
        assert start.elapsed_time(end) >= 1.0
    finally:
        kernel.unload()
        context.release()


@pytest.mark.gpu
def test_gate_holds_the_stream_until_it_expires(cuda_device):
    from syncless.bench._pp_cuda import Gate

    torch.cuda.set_device(cuda_device)
    gate = Gate()
    assert gate.cycles_per_ms > 1e5  # any GPU clock is above 100 MHz
    held = gate.hold(300.0)
    marker = torch.cuda.Event()
    marker.record()
    assert not held.query() and not marker.query()  # 300 ms of sleep cannot have passed yet
    marker.synchronize()
    assert held.query()


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

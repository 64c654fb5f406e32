"""The pp benchmark's GPU machinery on one GPU: the NVRTC full-SM kernel, the gate, the data pattern (the tiny
end-to-end run on two GPUs is in tests/multi_gpu/bench)."""

import pytest
import torch


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

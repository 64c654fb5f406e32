"""Issue 27 on a GPU: copies that bypass the wrappers, a .to torch fills on the host, uninstall() racing a thread,
quantized tensors, CUDA graph capture. Each failed on the code before its fix (argued per test).

Every test runs under emulated CC with the shim (``emulated_cc``); ``LATE_MS`` of sleep on the D2H stream in front of
a copy makes an offloaded copy land late, so a read that is not ordered after it sees the poison.
"""

from __future__ import annotations

import threading
import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

N = 1 << 14
LATE_MS = 60


def _d2h_after_current(cc):
    import torch

    d = cc.new_d2h_stream(torch.device("cuda", 0))
    d.wait_stream(torch.cuda.current_stream())
    return d


def test_a_to_whose_result_torch_fills_on_the_host_is_read_right_after_the_call(emulated_cc, cycles_per_ms):
    """Item 2: channels_last bf16 to fp32. torch fills the non-contiguous pinned result on the host before it
    returns; the shim used to offload it, so a read right after the call saw unwritten memory."""
    import torch

    dev = torch.device("cuda", 0)
    x = torch.randn(2, 8, 16, 16, device=dev).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    expected = x.float().cpu()
    d = _d2h_after_current(emulated_cc)
    with torch.cuda.stream(d):
        torch.cuda._sleep(cycles_per_ms * LATE_MS)
        out = x.to("cpu", torch.float32, non_blocking=True)
        read_at_once = out.clone()
    assert torch.equal(read_at_once, expected)
    assert emulated_cc.stats().left_alone.get("noncontiguous_target") == 1 and emulated_cc.stats().offloaded == 0
    torch.cuda.synchronize()


def test_a_thread_inside_a_wrapper_during_uninstall_does_not_offload_behind_it(emulated_cc, cycles_per_ms,
                                                                                monkeypatch):
    """Item 3: a thread held in the pinned allocation while uninstall() ran used to submit its job afterwards,
    which no patched synchronize covered any more: torch.cuda.synchronize() returned before the worker wrote."""
    import torch

    from syncless.cc import _d2h

    dev = torch.device("cuda", 0)
    expected = torch.randn(1 << 22)  # 16 MiB: the old code's late worker copy takes long enough to be seen
    src = expected.to(dev)
    d = _d2h_after_current(emulated_cc)
    entered, release = threading.Event(), threading.Event()
    real = _d2h.pinned_block

    def held(*args, **kwargs):
        entered.set()
        release.wait(10)  # "blocked in the pinned allocation" (the fast lane's and the general path's)
        return real(*args, **kwargs)

    monkeypatch.setattr(_d2h, "pinned_block", held)
    out = []

    def issue():
        with torch.cuda.stream(d):
            torch.cuda._sleep(cycles_per_ms * LATE_MS)
            out.append(src.to("cpu", non_blocking=True))

    caller = threading.Thread(target=issue)
    caller.start()
    assert entered.wait(10)
    emulated_cc.uninstall()
    release.set()
    caller.join(30)
    assert out, "the caller did not finish"
    torch.cuda.synchronize()  # torch's own now: covers torch's own copy, never a worker's
    assert torch.equal(out[0], expected)


def test_a_quantized_tensors_d2h_is_torchs_own(emulated_cc):
    """Item 6: a quantized CUDA tensor's .to('cpu', non_blocking=True) on a D2H stream was offloaded, and the
    pinned empty_strided of a quantized dtype raised out of Tensor.to."""
    import torch

    dev = torch.device("cuda", 0)
    q = torch.quantize_per_tensor(torch.randn(N, device=dev), 0.05, 0, torch.qint8)
    expected = q.int_repr().cpu()
    d = _d2h_after_current(emulated_cc)
    with torch.cuda.stream(d):
        out = q.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    assert out.is_quantized and torch.equal(out.int_repr(), expected)
    assert emulated_cc.stats().left_alone.get("layout") == 1


def test_a_direct_capture_begins_after_the_pending_copies(emulated_cc, cycles_per_ms):
    """Item 7: a copy pending at a direct CUDAGraph.capture_begin() made the worker synchronize during the global
    capture (its copy lands ~LATE_MS in, while the capture is open), which invalidated it: capture_end raised."""
    import torch

    dev = torch.device("cuda", 0)
    expected = torch.randn(N)
    src = expected.to(dev)
    d = _d2h_after_current(emulated_cc)
    with torch.cuda.stream(d):
        torch.cuda._sleep(cycles_per_ms * LATE_MS)
        out = src.to("cpu", non_blocking=True)  # offloaded, pending
    assert emulated_cc.stats().offloaded == 1
    x = torch.zeros(N, device=dev)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        y = x + 1
        time.sleep(2 * LATE_MS / 1000)  # the capture stays open past the time the copy lands
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), torch.ones(N)) and torch.equal(out, expected)


def test_an_offload_during_a_capture_is_torchs_own_copy(emulated_cc):
    """Item 7: the capturing thread copying on a D2H stream that did not join the capture was offloaded, and the
    worker's synchronize ran during the global capture (the capture stays open for 200 ms here): capture_end raised.
    Now nothing is offloaded while a capture is open (counted as ``capturing``) and the emulator makes no wait."""
    import torch

    dev = torch.device("cuda", 0)
    x = torch.randn(N, device=dev)
    expected = x.cpu()
    h = torch.full((N,), float("nan")).pin_memory()
    d = emulated_cc.new_d2h_stream(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        with torch.cuda.stream(d):
            h.copy_(x, non_blocking=True)
        time.sleep(0.2)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(h, expected) and torch.equal(y.cpu(), expected * 2)
    assert emulated_cc.stats().left_alone.get("capturing", 0) >= 1 and emulated_cc.stats().offloaded == 0


@pytest.mark.parametrize("via", ["setitem", "storage_copy", "new_tensor", "as_tensor"])
def test_a_copy_that_bypasses_the_wrappers_is_ordered_after_the_offloaded_one(emulated_cc, cycles_per_ms, via):
    """Item 1: on a D2H stream, ``h.copy_(a, non_blocking=True)`` (offloaded, late) then a copy that torch runs in
    C++ (``h[:] = b``, ``UntypedStorage.copy_``; or an upload of ``h``: ``new_tensor``, ``torch.as_tensor``). torch
    orders the second after the first on D; the worker used to write ``a`` after ``b`` (or after ``h`` was read)."""
    import warnings

    import torch

    dev = torch.device("cuda", 0)
    a, b = torch.randn(N), torch.randn(N)
    a_dev, b_dev = a.to(dev), b.to(dev)
    h = torch.full((N,), float("nan")).pin_memory()
    d = _d2h_after_current(emulated_cc)
    made = None
    with torch.cuda.stream(d), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # new_tensor's "copy construct" advice
        torch.cuda._sleep(cycles_per_ms * LATE_MS)
        h.copy_(a_dev, non_blocking=True)
        if via == "setitem":
            h[:] = b_dev
        elif via == "storage_copy":
            h.untyped_storage().copy_(b_dev.untyped_storage())
        elif via == "new_tensor":
            made = b_dev.new_tensor(h)
        else:
            made = torch.as_tensor(h, device=dev)
    d.synchronize()
    assert emulated_cc.stats().offloaded == 1
    if made is None:
        assert torch.equal(h, b), "the offloaded copy landed after the later copy"
    else:
        assert torch.equal(made.cpu(), a), "the upload read h before the offloaded copy wrote it"
    assert emulated_cc.stats().bypass_waits == 1


def test_d2h_streams_made_per_request_can_be_closed(emulated_cc):
    """Item 8: one D2H stream per request, each closed after its readback: threads do not pile up and every
    readback is right."""
    import torch

    dev = torch.device("cuda", 0)
    threads_before = threading.active_count()
    for _ in range(40):
        expected = torch.randn(1024)
        src = expected.to(dev)
        d = emulated_cc.new_d2h_stream(dev)
        d.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(d):
            torch.cuda._sleep(1_000_000)  # queued work: offloaded (a small copy from an idle stream is torch's own)
            out = src.to("cpu", non_blocking=True)
        emulated_cc.close_d2h_stream(d)
        assert torch.equal(out, expected) and not emulated_cc.is_d2h_stream(d)
    assert threading.active_count() <= threads_before + 1
    assert emulated_cc.stats().offloaded == 40


def test_a_failed_copy_reaches_the_issuing_threads_covering_call(emulated_cc, driver_fails_copies_into):
    """Item 4: an unrelated thread's torch.cuda.synchronize() used to take (and forget) the error of a copy this
    thread issued; now it raises it too (once), and this thread's own event synchronize still raises it."""
    import torch

    dev = torch.device("cuda", 0)
    d = _d2h_after_current(emulated_cc)
    src = torch.randn(16, device=dev)
    doomed = torch.empty(16).pin_memory()

    with driver_fails_copies_into(doomed):
        with torch.cuda.stream(d):
            doomed.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        other = []
        thread = threading.Thread(target=lambda: other.append(_raised(torch.cuda.synchronize)))
        thread.start()
        thread.join(30)
        assert len(other) == 1 and isinstance(other[0], emulated_cc.D2HCopyError), other
        with pytest.raises(emulated_cc.D2HCopyError, match="injected copy failure"):
            ready.synchronize()
        ready.synchronize()  # raised once


def _raised(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - handed back to the test
        return err
    return None

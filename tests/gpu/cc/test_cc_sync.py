"""Synchronization semantics, host-not-waiting, worker failures, capture/compile, uninstall, NVML."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

N = 1 << 16


def _pending_d2h(cc, cycles_per_ms, ms=30, into=None):
    """Queue ``ms`` of work on the current stream, then a D2H of its result on a D2H stream.

    Returns (out, expected, producer_done): ``expected`` is computed on the host beforehand.
    """
    import torch

    dev = torch.device("cuda", 0)
    d2h = cc.new_d2h_stream(dev)
    host = torch.randn(N)
    src = host.to(dev)  # blocking: ready before the queued work
    src * 2  # load the kernel first: a first launch may wait for the GPU (lazy module loading)
    torch.cuda._sleep(cycles_per_ms * ms)
    doubled = src * 2
    producer_done = torch.cuda.Event()
    producer_done.record()
    d2h.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(d2h):
        if into is None:
            out = doubled.to("cpu", non_blocking=True)
        else:
            out = into
            out.copy_(doubled, non_blocking=True)
    _pending_d2h.last_stream = d2h  # for a test that records on it
    return out, host * 2, producer_done


def _idle_event(kind="cuda"):
    import torch

    other = torch.cuda.Stream()
    event = torch.cuda.Event() if kind == "cuda" else torch.Event(device="cuda")
    event.record(other)  # nothing queued on `other`: the GPU side of this event is done at once
    return event, other


def test_d2h_on_registered_stream_returns_before_data_is_ready(emulated_cc, cycles_per_ms):
    import torch

    poisoned = torch.full((N,), float("nan")).pin_memory()
    # A long producer: only a copy call that waits for the GPU lets it finish first. (This caught a
    # 2.9 s block in the first offloaded copy of a process: an import inside the shim's shape check.)
    out, expected, producer_done = _pending_d2h(emulated_cc, cycles_per_ms, ms=300, into=poisoned)
    still_poisoned = bool(torch.isnan(out).all())
    producer_running = not producer_done.query()
    assert producer_running, "the copy call waited for the producer"
    assert still_poisoned
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert emulated_cc.stats().offloaded == 1


@pytest.mark.parametrize("kind", ["cuda", "torch"])
def test_event_synchronize_and_query_cover_pending_d2h(emulated_cc, cycles_per_ms, kind):
    """An event recorded on the D2H stream after the copy covers it; so does one on an unrelated idle stream
    (the seed's any-event rule: under CC without the shim the copy had finished at its call), while one recorded
    on that idle stream before the copy's call is done at once, as it is without syncless."""
    import torch

    before, _ = _idle_event(kind)
    out, expected, _ = _pending_d2h(emulated_cc, cycles_per_ms)
    assert before.query() is True
    idle, _ = _idle_event(kind)
    assert idle.query() is False  # recorded after the copy's call: it covers the copy
    d2h = _pending_d2h.last_stream
    event = torch.cuda.Event() if kind == "cuda" else torch.Event(device="cuda")
    event.record(d2h)
    assert event.query() is False  # the D2H stream's own queue is done; its copy is not
    event.synchronize()
    assert torch.equal(out, expected)
    assert event.query() is True


@pytest.mark.parametrize("how", ["stream", "cuda_sync", "accelerator_sync", "stream_query"])
def test_stream_and_device_synchronize_cover_pending_d2h(emulated_cc, cycles_per_ms, how):
    import torch

    out, expected, _ = _pending_d2h(emulated_cc, cycles_per_ms)
    other = torch.cuda.Stream()
    if how == "stream":
        other.synchronize()
    elif how == "cuda_sync":
        torch.cuda.synchronize()
    elif how == "accelerator_sync":
        if not hasattr(torch, "accelerator"):
            pytest.skip("torch.accelerator is not in this torch")
        torch.accelerator.synchronize()
    else:
        assert other.query() is False
        while not other.query():
            pass
    assert torch.equal(out, expected)


def test_event_recorded_on_d2h_stream_covers_what_it_waited_for(emulated_cc, cycles_per_ms):
    import torch

    cc = emulated_cc
    d2h = cc.new_d2h_stream()
    torch.cuda._sleep(cycles_per_ms * 20)
    d2h.wait_stream(torch.cuda.current_stream())
    event = d2h.record_event()
    assert event.query() is False  # recorded behind the producer's queued work
    event.synchronize()
    assert event.query() is True


def test_host_does_not_wait_for_queued_work_on_h2d(cycles_per_ms):
    import torch

    import syncless.cc as cc

    dev = torch.device("cuda", 0)
    host = torch.randn(1 << 18).pin_memory()  # 1 MiB
    cc.uninstall()
    results = {}
    for setup in ("emulated", "emulated+shim"):
        cc.install("emulate") if setup == "emulated+shim" else cc.emulate()
        torch.cuda._sleep(cycles_per_ms * 20)
        queued = torch.cuda.Event()
        queued.record()
        gpu = host.to(dev, non_blocking=True)
        results[setup] = queued.query()  # True means the host waited for the 20 ms of work
        torch.cuda.synchronize()
        assert torch.equal(gpu.cpu(), host)
        cc.uninstall()
    assert results == {"emulated": True, "emulated+shim": False}


def test_into_existing_and_registered_targets_host_does_not_wait(emulated_cc, cycles_per_ms):
    import torch

    cc = emulated_cc
    dev = torch.device("cuda", 0)
    target = torch.zeros(1 << 18, device=dev)
    registered = torch.zeros(1 << 18, device=dev)
    cc.register_inplace_h2d_target(registered)
    torch.cuda.synchronize()
    for dst in (target, registered[: 1 << 17]):
        host = torch.randn(dst.shape[0]).pin_memory()
        torch.cuda._sleep(cycles_per_ms * 20)
        queued = torch.cuda.Event()
        queued.record()
        dst.copy_(host, non_blocking=True)
        assert queued.query() is False
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), host)
    assert cc.stats().staged == 1 and cc.stats().in_place == 1


def test_wrong_shape_d2h_is_refused_at_the_call(emulated_cc):
    import torch

    cc = emulated_cc
    d2h = cc.new_d2h_stream()
    src = torch.randn(16, device="cuda")
    wrong_shape = torch.empty(5).pin_memory()
    d2h.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(d2h), pytest.raises(RuntimeError, match=r"\(16,\).*\(5,\)"):
        wrong_shape.copy_(src, non_blocking=True)
    torch.cuda.synchronize()  # nothing was queued, nothing fails later


def test_worker_failure_surfaces_at_next_synchronize(emulated_cc, cycles_per_ms, driver_fails_copies_into):
    import torch

    cc = emulated_cc
    d2h = cc.new_d2h_stream()
    src = torch.randn(16, device="cuda")
    doomed = torch.empty(16).pin_memory()

    with driver_fails_copies_into(doomed):
        d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(d2h):
            doomed.copy_(src, non_blocking=True)  # returns; the worker's copy fails
        with pytest.raises(cc.D2HCopyError) as info:
            torch.cuda.synchronize()
    assert "injected copy failure" in info.value.worker_traceback
    assert "copy_" in str(info.value)
    torch.cuda.synchronize()  # reported once
    # The process stays usable.
    out, expected, _ = _pending_d2h(cc, cycles_per_ms, ms=2)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("n", [16, 1024])  # 64 bytes: an inline upload outside a capture (its bytes would freeze)
def test_capture_leaves_copies_alone(emulated_cc, n):
    import torch

    cc = emulated_cc
    dev = torch.device("cuda", 0)
    host = torch.randn(n).pin_memory()
    static = torch.zeros(n, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture
        static.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    cc.reset_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.copy_(host, non_blocking=True)
        static.mul_(2)
    assert cc.stats().left_alone.get("capturing", 0) == 1
    assert cc.stats().staged == 0 and cc.stats().inlined == 0 and cc.stats().emulated_waits == 0
    fresh = torch.randn(n)
    host.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static.cpu(), fresh * 2)


def test_compile_traces_through_the_shim(emulated_cc):
    import torch

    def step(x):
        return x.to("cuda", non_blocking=True) * 2

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    host = torch.randn(256).pin_memory()
    out = compiled(host)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), host * 2)


def test_uninstall_restores_every_patched_attribute_on_gpu(cycles_per_ms):
    import torch

    import syncless.cc as cc
    from syncless.cc import _sync_patches

    cc.uninstall()
    targets = [(torch.Tensor, n) for n in ("to", "cuda", "copy_")]
    targets += [(o, n) for o, n, _ in _sync_patches.patch_targets()]
    before = {(id(o), n): getattr(o, n) for o, n in targets}
    cc.install("emulate")
    out, expected, _ = _pending_d2h(cc, cycles_per_ms, ms=2)
    assert any(getattr(o, n) is not before[(id(o), n)] for o, n in targets)
    cc.uninstall()  # waits for the queued copy
    assert torch.equal(out, expected)
    assert all(getattr(o, n) is before[(id(o), n)] for o, n in targets)


def test_nvml_reports_cc_off_on_reference_gpus():
    import syncless.cc as cc

    assert cc.is_confidential_compute() is False
    decision = cc.decide_mode("auto")
    assert decision.mode == "off" and "NVML reports" in decision.reason


def test_staged_copies_leave_the_current_stream_and_device_as_they_were(emulated_cc, monkeypatch):
    """The shim switches to its staging stream with two set_stream calls (cheaper than torch.cuda.stream);
    after each staged form, and after one that raises inside, the caller's stream is current again.
    With two GPUs, a staged copy to the other GPU also leaves the current device alone."""
    import torch

    from syncless.cc import _staging

    dev = torch.device("cuda", 0)
    mine = torch.cuda.Stream(dev)
    host = torch.randn(64, 64).pin_memory()
    target = torch.zeros(64, 64, device=dev)
    emulated_cc.register_inplace_h2d_target(target)
    with torch.cuda.stream(mine):
        forms = [
            lambda: host.to(dev, non_blocking=True),
            lambda: host.cuda(dev, non_blocking=True),
            lambda: torch.empty(64, 64, device=dev).copy_(host, non_blocking=True),
            lambda: target.copy_(host, non_blocking=True),
        ]
        for form in forms:
            torch.cuda._sleep(5_000_000)  # work queued on `mine`: staged (on an idle stream .to is torch's own)
            out = form()
            assert torch.cuda.current_stream(dev) == mine
            assert torch.equal(out.cpu(), host)
        monkeypatch.setattr(_staging, "_torch_own", lambda name: lambda *a, **k: (_ for _ in ()).throw(
            RuntimeError("raised beneath the shim")))
        torch.cuda._sleep(5_000_000)
        with pytest.raises(RuntimeError, match="raised beneath the shim"):
            host.to(dev, non_blocking=True)
        assert torch.cuda.current_stream(dev) == mine
        monkeypatch.undo()
        if torch.cuda.device_count() > 1:
            other = torch.device("cuda", 1)
            before = torch.cuda.current_stream(other)
            out = host.to(other, non_blocking=True)
            assert torch.cuda.current_device() == 0
            assert torch.cuda.current_stream(dev) == mine and torch.cuda.current_stream(other) == before
            assert torch.equal(out.cpu(), host)

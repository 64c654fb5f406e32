"""An offloaded D2H copy is ordered exactly as torch would order it on the D2H stream (issue 14's bugs and kin).

Each test makes a slow producer (``torch.cuda._sleep`` then a write of fresh
random data), orders the D2H stream after it in one of the ways torch
allows, and checks bit for bit that the host sees the new data. Before the
fix the worker waited only for the stream the D2H stream had *last* waited
on (``wait_stream``), so (a) two producers, (b) ``wait_event``, (c) a kernel
queued on the D2H stream itself behind a producer, (d) a later kernel on
the D2H stream that overwrites the source and (e) a stream that waits for
the D2H stream before overwriting the source all read stale or future data.
Each runs with the shim alone and with the shim over the CC emulator.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

TRIALS = 4
N = 1 << 16


@pytest.fixture(params=["on", "emulate"])
def shim(request):
    """The shim alone ("on") or the shim over the CC emulator ("emulate"); restored afterwards."""
    import syncless.cc as cc

    cc.uninstall()
    cc.install(request.param)
    yield cc
    cc.uninstall()


def _setup():
    """Return (dev, src, new, old, host) with src holding ``old``, all settled on the GPU; host poisoned."""
    import torch

    dev = torch.device("cuda", 0)
    old = torch.randn(N, device=dev)
    new = torch.randn(N, device=dev)
    src = old.clone()
    host = torch.full((N,), float("nan")).pin_memory()
    torch.cuda.synchronize()
    return dev, src, new, old, host


def _slow_write(stream, dst, value, cycles):
    """On ``stream``: ~``cycles`` of sleep, then ``dst`` <- ``value`` (the slow producer)."""
    import torch

    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        dst.copy_(value)


def _d2h_behind_a_slow_producer(cc, dev, cycles):
    """A new D2H stream ordered after a producer stream that sleeps ``cycles`` first (so the worker waits)."""
    import torch

    producer = torch.cuda.Stream(dev)
    d2h = cc.new_d2h_stream(dev)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(cycles)
    d2h.wait_stream(producer)
    return d2h


def _assert_bits(host, expected):
    import torch

    expected = expected.cpu()
    assert torch.equal(host.view(torch.int32), expected.view(torch.int32)), (
        f"{int((host.view(torch.int32) != expected.view(torch.int32)).sum())} of {host.numel()} elements differ")


def test_two_producers_are_both_waited_for(shim, cycles_per_ms):
    """Bug (a): d2h.wait_stream(p1); d2h.wait_stream(p2) with p1 slow and p2 idle."""
    import torch

    cc = shim
    for _ in range(TRIALS):
        dev, src, new, _, host = _setup()
        p1, p2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        d2h = cc.new_d2h_stream(dev)
        _slow_write(p1, src, new, 20 * cycles_per_ms)
        d2h.wait_stream(p1)
        d2h.wait_stream(p2)  # the last producer is idle
        with torch.cuda.stream(d2h):
            host.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        _assert_bits(host, new)
        torch.cuda.synchronize()


def test_wait_event_is_honoured_after_a_wait_stream(shim, cycles_per_ms):
    """Bug (b): d2h.wait_stream(p2); d2h.wait_event(e) with e recorded on p1 after a slow write."""
    import torch

    cc = shim
    for trial in range(TRIALS):
        dev, src, new, _, host = _setup()
        p1, p2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        d2h = cc.new_d2h_stream(dev)
        _slow_write(p1, src, new, 20 * cycles_per_ms)
        e = torch.cuda.Event() if trial % 2 == 0 else torch.Event(device=dev)  # both event types
        e.record(p1)
        d2h.wait_stream(p2)
        if trial % 2 == 0:
            d2h.wait_event(e)
        else:
            e.wait(d2h)
        with torch.cuda.stream(d2h):
            out = src.to("cpu", non_blocking=True)
        d2h.synchronize()
        _assert_bits(out, new)
        torch.cuda.synchronize()


def test_work_queued_on_the_d2h_stream_is_waited_for(shim, cycles_per_ms):
    """A kernel the caller runs on the D2H stream (behind a producer) writes the source of the next copy."""
    import torch

    cc = shim
    for _ in range(TRIALS):
        dev, src, new, _, host = _setup()
        producer = torch.cuda.Stream(dev)
        d2h = cc.new_d2h_stream(dev)
        d2h.wait_stream(producer)  # an idle producer: the old code recorded the copy's event there
        _slow_write(d2h, src, new, 20 * cycles_per_ms)
        with torch.cuda.stream(d2h):
            host.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        _assert_bits(host, new)


def test_later_work_on_the_d2h_stream_waits_for_the_copy(shim, cycles_per_ms):
    """A kernel queued on the D2H stream after the copy overwrites the source: the copy still reads the old data."""
    import torch

    cc = shim
    for _ in range(TRIALS):
        dev, src, new, old, host = _setup()
        d2h = _d2h_behind_a_slow_producer(cc, dev, 10 * cycles_per_ms)  # the copy's producer is slow ...
        with torch.cuda.stream(d2h):
            host.copy_(src, non_blocking=True)
            src.copy_(new)  # ... and this overwrite is queued on the D2H stream after the copy
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        _assert_bits(host, old)
        _assert_bits(src.cpu(), new)


def _overwrite(how, src, new):
    """Overwrite ``src`` with a kernel (never a copy) on the current stream."""
    import torch

    if how == "zero_":
        src.zero_()
    elif how == "fill_":
        src.fill_(7.0)
    elif how == "mul_":
        src.mul_(3.0)
    else:  # "out="
        torch.add(new, 1.0, out=src)


@pytest.mark.parametrize("overwrite", ["zero_", "fill_", "mul_", "out=", "reuse"])
@pytest.mark.parametrize("form", ["copy_", "to"])
def test_a_kernel_on_the_d2h_stream_after_the_copy_does_not_reach_it(shim, cycles_per_ms, overwrite, form):
    """A kernel (not a copy) queued on the D2H stream after the copy overwrites its source.

    torch runs that kernel after its copy, so the host gets the old data. The offloaded copy used to read the
    source when the worker got to it, after such a kernel (found in review). ``reuse``: the source is a
    temporary made on the D2H stream and dropped right after the call; the next allocation there takes its
    block and a kernel writes it.
    """
    import torch

    cc = shim
    for _ in range(TRIALS):
        dev, src, new, old, host = _setup()
        d2h = _d2h_behind_a_slow_producer(cc, dev, 10 * cycles_per_ms)  # so the worker waits for it
        with torch.cuda.stream(d2h):
            source = src * 1 if overwrite == "reuse" else src  # `src * 1` runs on D
            if form == "copy_":
                host.copy_(source, non_blocking=True)
                result = host
            else:
                result = source.to("cpu", non_blocking=True)
            if overwrite == "reuse":
                del source
                again = torch.empty(N, device=dev)  # the caching allocator hands out the temporary's block
                torch.add(new, 1.0, out=again)
            else:
                _overwrite(overwrite, src, new)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        _assert_bits(result, old)
        torch.cuda.synchronize()


def test_no_room_for_a_snapshot_runs_torchs_own_copy(shim, cycles_per_ms, monkeypatch):
    """When the snapshot cannot be allocated, the copy is torch's own on the D2H stream: ordered, not offloaded."""
    import torch

    from syncless.cc import _d2h_job

    cc = shim

    def no_room(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(_d2h_job, "snapshot", no_room)
    monkeypatch.setattr(_d2h_job, "snapshot_block", no_room)  # the fast lane's (a contiguous source's)
    before = cc.stats().offloaded
    dev, src, new, old, host = _setup()
    producer = torch.cuda.Stream(dev)
    d2h = cc.new_d2h_stream(dev)
    _slow_write(producer, src, new, 10 * cycles_per_ms)
    d2h.wait_stream(producer)
    with torch.cuda.stream(d2h):
        host.copy_(src, non_blocking=True)
        out = src.to("cpu", non_blocking=True)
        src.zero_()
    d2h.synchronize()
    _assert_bits(host, new)
    _assert_bits(out, new)
    assert cc.stats().offloaded == before


def test_streams_ordered_after_the_d2h_stream_wait_for_the_copy(shim, cycles_per_ms):
    """P.wait_stream(d2h) then P overwrites the source (and reads the pinned result back up): ordered on the GPU."""
    import torch

    cc = shim
    for trial in range(TRIALS):
        dev, src, new, old, host = _setup()
        consumer = torch.cuda.Stream(dev)
        d2h = _d2h_behind_a_slow_producer(cc, dev, 10 * cycles_per_ms)
        with torch.cuda.stream(d2h):
            host.copy_(src, non_blocking=True)
        if trial % 2 == 0:
            consumer.wait_stream(d2h)
        else:
            consumer.wait_event(d2h.record_event())
        with torch.cuda.stream(consumer):
            src.copy_(new)  # overwrite the source after the copy (torch's order)
            back = torch.empty(N, device=dev)
            back.copy_(host)  # blocking H2D of the D2H result: it must be the old data
        consumer.synchronize()
        _assert_bits(host, old)
        _assert_bits(back.cpu(), old)
        _assert_bits(src.cpu(), new)


def test_staged_h2d_reads_host_memory_after_the_d2h_that_writes_it(shim, cycles_per_ms):
    """D2H x -> pinned h (offloaded, or torch's own on an ordinary stream), then a stream ordered after it uploads h.

    The shim's H2D runs on its idle staging stream; it must still read h after the D2H has written it.
    """
    import torch

    cc = shim
    for trial in range(TRIALS):
        dev, src, new, _, host = _setup()
        producer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        stream = cc.new_d2h_stream(dev) if trial % 2 == 0 else torch.cuda.Stream(dev)
        _slow_write(producer, src, new, 20 * cycles_per_ms)
        stream.wait_stream(producer)
        with torch.cuda.stream(stream):
            host.copy_(src, non_blocking=True)
        consumer.wait_stream(stream)
        with torch.cuda.stream(consumer):
            up = host.to(dev, non_blocking=True) if trial % 4 < 2 else torch.empty(N, device=dev).copy_(
                host, non_blocking=True)
            result = up * 1
        torch.cuda.synchronize()
        _assert_bits(result.cpu(), new)


def test_staged_transposed_h2d_reads_host_memory_in_stream_order(shim, cycles_per_ms):
    """``d.t().copy_(h.t(), non_blocking=True)`` behind a D2H into ``h`` queued on the same stream.

    torch moves two transposes of one dtype as one block, in stream order, so it reads ``h`` after the D2H.
    The shim once made ``h.t()`` contiguous at the call (right only when torch itself makes a temporary), and
    read ``h`` before the D2H had written it.
    """
    import torch

    cc = shim
    side = 256
    for trial in range(TRIALS):
        dev = torch.device("cuda", 0)
        old, new = torch.randn(side, side, device=dev), torch.randn(side, side, device=dev)
        src = old.clone()
        host = torch.full((side, side), float("nan")).pin_memory()
        torch.cuda.synchronize()
        stream = cc.new_d2h_stream(dev) if trial % 2 == 0 else torch.cuda.Stream(dev)
        _slow_write(stream, src, new, 20 * cycles_per_ms)
        with torch.cuda.stream(stream):
            host.copy_(src, non_blocking=True)
            up = torch.empty(side, side, device=dev)
            up.t().copy_(host.t(), non_blocking=True)
            result = up * 1
        torch.cuda.synchronize()
        _assert_bits(result.cpu(), new)


@pytest.mark.parametrize("form", ["to float16", "cuda contiguous_format"])
def test_a_fresh_h2d_that_converts_reads_a_transposed_source_at_the_call(shim, cycles_per_ms, form):
    """``h[0].t().to("cuda", float16, non_blocking=True)``, then the host overwrites ``h[0]`` (legal: torch read it).

    torch makes the transposed source contiguous on the host at the call (its dtype or layout changes). The shim
    once staged it as it lay, in stream order, behind an unrelated D2H into another row of ``h`` still queued on
    a slow stream, so it read the overwrite (found in review; deterministic under "on").
    """
    import torch

    side = 512
    for _ in range(TRIALS):
        dev = torch.device("cuda", 0)
        h = torch.zeros(3, side, side).pin_memory()
        old = torch.randn(side, side)
        h[0].copy_(old)
        src = h[0].t()
        x = torch.randn(side, side, device=dev)
        slow = torch.cuda.Stream(dev)
        torch.cuda.synchronize()
        with torch.cuda.stream(slow):
            torch.cuda._sleep(20 * cycles_per_ms)
            h[2].copy_(x, non_blocking=True)  # torch's own D2H, noted under h's storage
        if form == "to float16":
            y = src.to(dev, torch.float16, non_blocking=True)
            expected = old.t().to(torch.float16)
        else:
            y = src.cuda(non_blocking=True, memory_format=torch.contiguous_format)
            expected = old.t().contiguous()
        h[0].fill_(7.0)
        torch.cuda.synchronize()
        assert y.is_contiguous() == expected.is_contiguous() and y.stride() == expected.stride()
        assert torch.equal(y.cpu(), expected)


@pytest.mark.parametrize("read", ["cpu", "item", "tolist"])
def test_a_blocking_read_on_the_d2h_stream_waits_for_its_offloaded_copies(shim, cycles_per_ms, read):
    """On ``D``: an offloaded ``h.copy_(src)``, then ``x.cpu()`` / ``x.item()`` / ``x.tolist()`` (blocking reads).

    torch returns from such a read once ``D`` has reached it, so the earlier copy into ``h`` is complete and
    the program may read ``h`` with no other synchronize (found in review: the shim once returned with the
    offloaded copy still pending).
    """
    import torch

    cc = shim
    big = 8 << 20  # 32 MiB: the worker's copy takes milliseconds, much longer than the 2-element read
    for _ in range(TRIALS):
        dev = torch.device("cuda", 0)
        src, new = torch.randn(big, device=dev), torch.randn(big, device=dev)
        host = torch.full((big,), float("nan")).pin_memory()
        torch.cuda.synchronize()
        producer = torch.cuda.Stream(dev)
        d2h = cc.new_d2h_stream(dev)
        _slow_write(producer, src, new, 20 * cycles_per_ms)
        d2h.wait_stream(producer)
        with torch.cuda.stream(d2h):
            host.copy_(src, non_blocking=True)
            small = src[:2]
            value = {"cpu": lambda: small.cpu(), "item": lambda: small[0].item(), "tolist": lambda: small.tolist()}[
                read]()
        _assert_bits(host, new)  # read right away, as torch allows
        del value
        torch.cuda.synchronize()


def test_an_inference_tensor_target_is_refused_at_the_call(shim):
    """A D2H into an inference tensor outside inference mode: torch raises at the call, and so must the shim."""
    import torch

    cc = shim
    dev, src, _, _, _ = _setup()
    with torch.inference_mode():
        host = torch.empty(N).pin_memory()
    d2h = cc.new_d2h_stream(dev)
    d2h.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(d2h), pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        host.copy_(src, non_blocking=True)
    torch.cuda.synchronize()


def test_a_complex_to_real_d2h_warns_on_the_calling_thread(shim):
    """torch warns that the imaginary part is dropped, at the call; offloaded, it warned on the worker thread."""
    import warnings

    import torch

    cc = shim
    dev = torch.device("cuda", 0)
    z = torch.randn(N, dtype=torch.complex64, device=dev)
    host = torch.full((N,), float("nan")).pin_memory()
    torch.cuda.synchronize()
    d2h = cc.new_d2h_stream(dev)
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch warns once per process otherwise
    try:
        with warnings.catch_warnings(record=True) as seen, torch.cuda.stream(d2h):
            warnings.simplefilter("always")
            host.copy_(z, non_blocking=True)
            d2h.synchronize()
    finally:
        torch.set_warn_always(before)
    assert any("imaginary" in str(w.message) for w in seen), [str(w.message) for w in seen]
    _assert_bits(host, z.real)

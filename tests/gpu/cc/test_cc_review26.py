"""Issue 33 on a GPU, the review round of session 26: compiled regions that synchronize, uploads of memory an
offloaded copy is still writing, a blocking read under a dispatch mode, registered targets by their bytes, uploads
inside a forward-AD level. Fresh random data, bit-exact against what torch (or CC without the shim) gives.

An offloaded copy is kept pending by ``LATE_MS`` of sleep on its D2H stream in front of it, and is large enough
(1 MiB) to be offloaded rather than read back at the call.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

LATE_MS = 50
N = 1 << 18  # float32 elements: 1 MiB


def _random(torch, shape, dev):
    gen = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    return torch.randn(shape, device=dev, generator=gen)


def _offload_into(torch, d, host, src, cycles_per_ms):
    """``host.copy_(src, non_blocking=True)`` on D2H stream ``d``, behind ``LATE_MS`` of GPU work (offloaded)."""
    d.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(d):
        torch.cuda._sleep(cycles_per_ms * LATE_MS)
        host.copy_(src, non_blocking=True)


SYNCS = ("device", "event", "stream")


def _sync(torch, kind, event, stream):
    if kind == "device":
        torch.cuda.synchronize()
    elif kind == "event":
        event.synchronize()
    else:
        stream.synchronize()


@pytest.mark.parametrize("kind", SYNCS)
def test_a_compiled_region_that_synchronizes_covers_offloaded_copies_and_compiles_as_torch_does(cycles_per_ms, kind):
    """The sync patches were traced by dynamo: their reads of the covers became guards (a recompile per offloaded
    copy, an error under ``fullgraph=True`` at the limit), and a ``torch.Event`` made in C was no longer one. Now
    the region compiles as it does under plain torch (the same frames, no recompiles as copies come and go), and
    its synchronize still covers the copies offloaded before it: each step's host buffer is final after it."""
    import torch
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    import syncless.cc as cc

    dev = torch.device("cuda", 0)

    def step(x, event, stream):
        _sync(torch, kind, event, stream)
        return x * 2

    def run(installed: bool) -> tuple[int, bool]:
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(step, backend=counter)
        d = cc.new_d2h_stream(dev) if installed else torch.cuda.Stream(dev)
        x = torch.ones(4, device=dev)
        for _ in range(6):
            src = _random(torch, N, dev)
            expected = src.cpu()
            host = torch.empty(N, pin_memory=True)
            _offload_into(torch, d, host, src, cycles_per_ms)
            event = torch.cuda.Event()
            event.record(d)
            assert torch.equal(compiled(x, event, d), x * 2)
            assert torch.equal(host, expected), f"{kind}: the compiled synchronize returned before the copy"
        try:
            torch._dynamo.reset()
            torch.compile(step, fullgraph=True, backend="eager")(x, event, d)
            full = True
        except Exception:  # noqa: BLE001 - plain torch's own answer is the oracle
            full = False
        if installed:
            cc.close_d2h_stream(d)
        return counter.frame_count, full

    cc.uninstall()
    plain_frames, plain_full = run(installed=False)
    cc.install("emulate")
    try:
        shim_frames, shim_full = run(installed=True)
    finally:
        cc.uninstall()
        torch._dynamo.reset()
    assert shim_frames == plain_frames, f"{kind}: {shim_frames} frames compiled with the shim, {plain_frames} without"
    assert shim_full or not plain_full, f"{kind}: fullgraph=True compiles under plain torch, not with the shim"


def test_every_event_is_a_torch_event_while_installed():
    """``isinstance`` against the covering ``torch.Event`` answers as against torch's own (dynamo asks it)."""
    import torch

    import syncless.cc as cc

    cc.uninstall()
    made_before = torch.cuda.Event()
    plain = (isinstance(made_before, torch.Event), isinstance(torch.cuda.Event(), torch.Event),
             issubclass(torch.cuda.Event, torch.Event))
    cc.install("emulate")
    try:
        assert (isinstance(made_before, torch.Event), isinstance(torch.cuda.Event(), torch.Event),
                issubclass(torch.cuda.Event, torch.Event)) == plain
        recorded = torch.cuda.current_stream().record_event()  # made in C
        assert isinstance(recorded, torch.Event)
        assert isinstance(torch.Event("cuda"), torch.Event)
    finally:
        cc.uninstall()


@pytest.mark.parametrize("form", ["cuda", "to", "copy_", "staged_cast", "staged_into_another_layout"])
def test_an_upload_of_memory_an_offloaded_copy_writes_reads_its_final_bytes(emulated_cc, cycles_per_ms, form):
    """A program written for CC without the shim: the readback has finished when its call returns, so an upload
    of its buffer right after reads the readback's bytes. The uploads left to torch (blocking ones) did not wait
    for the offloaded copy, and a staged one that torch reads at the call read before its wait."""
    import torch

    dev = torch.device("cuda", 0)
    side = 512
    src = _random(torch, (side, side), dev)
    expected = src.cpu()
    d = emulated_cc.new_d2h_stream(dev)
    host = torch.empty(side, side, pin_memory=True)
    _offload_into(torch, d, host, src, cycles_per_ms)  # the default stream is current again from here
    if form == "cuda":
        up, want = host.cuda(), expected
    elif form == "to":
        up, want = host.to(dev), expected
    elif form == "copy_":
        up, want = torch.empty(side, side, device=dev), expected
        up.copy_(host)
    elif form == "staged_cast":
        up, want = host.t().to(dev, dtype=torch.float64, non_blocking=True), expected.t().double()
    else:
        up, want = torch.empty(side, side, device=dev), expected.t()
        up.copy_(host.t(), non_blocking=True)
    assert torch.equal(up.cpu(), want)
    emulated_cc.close_d2h_stream(d)


def test_a_blocking_read_on_a_d2h_stream_under_a_dispatch_mode_waits_for_its_copies(emulated_cc, cycles_per_ms):
    """torch's ``item()`` on ``D`` returns once ``D`` has reached it, so the program may read what the copies
    before it on ``D`` wrote. Under a ``TorchDispatchMode`` the shim's wait was skipped."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    dev = torch.device("cuda", 0)
    src = _random(torch, N, dev)
    expected = src.cpu()
    d = emulated_cc.new_d2h_stream(dev)
    host = torch.empty(N, pin_memory=True)
    one = torch.ones(1, device=dev)
    d.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(d):
        torch.cuda._sleep(cycles_per_ms * LATE_MS)
        host.copy_(src, non_blocking=True)
        with PassThrough():
            assert one.item() == 1.0
        assert torch.equal(host, expected)
    emulated_cc.close_d2h_stream(d)


def test_a_registered_row_does_not_vouch_for_its_sibling_row(emulated_cc, cycles_per_ms):
    """Registering one row of a pool tensor made an upload into another row land in place on the staging stream,
    ahead of a kernel still reading that row. It is staged now: the reader sees the row as it was."""
    import torch

    dev = torch.device("cuda", 0)
    pool = _random(torch, (2, N), dev)
    before = pool[1].cpu()
    row0 = pool[0]
    emulated_cc.register_inplace_h2d_target(row0)
    torch.cuda.synchronize()
    new_row = torch.randn(N).pin_memory()
    torch.cuda._sleep(cycles_per_ms * LATE_MS)
    seen = pool[1].clone()  # a reader of the sibling row, queued behind the sleep
    pool[1].copy_(new_row, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), before)
    assert torch.equal(pool[1].cpu(), new_row)
    assert emulated_cc.stats().in_place == 0
    other = torch.randn(N).pin_memory()
    row0.copy_(other, non_blocking=True)  # the registered row itself lands in place
    torch.cuda.synchronize()
    assert torch.equal(pool[0].cpu(), other) and emulated_cc.stats().in_place == 1


def test_an_upload_inside_a_forward_ad_level_is_torchs_own_with_its_tangent(emulated_cc):
    """A staged upload's tangent was allocated on the staging stream and never marked as used by the current
    one; inside a dual level the upload is torch's own, tangent and all."""
    import torch
    import torch.autograd.forward_ad as fwAD

    dev = torch.device("cuda", 0)
    primal, tangent = torch.randn(4096).pin_memory(), torch.randn(4096).pin_memory()
    before = emulated_cc.stats().left_alone.get("autograd", 0)
    with fwAD.dual_level():
        up = fwAD.make_dual(primal, tangent).to(dev, non_blocking=True)
        got_primal, got_tangent = fwAD.unpack_dual(up)
        assert torch.equal(got_primal.cpu(), primal) and torch.equal(got_tangent.cpu(), tangent)
    assert emulated_cc.stats().left_alone.get("autograd", 0) == before + 1

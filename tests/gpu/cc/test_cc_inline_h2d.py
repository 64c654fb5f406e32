"""Small uploads written by one kernel from its launch parameters (``cc/_inline_h2d.py``), on a GPU.

Under emulated CC with the shim (``emulated_cc``), with fresh random bytes each run: bit-exact against the
source for every payload size class and its edges (4 and 8 bytes: one stream memory op), both call forms (``h.to(dev, non_blocking=True)`` and
``dst.copy_(h, non_blocking=True)``), pinned and pageable sources; stream order on the current stream (behind
queued work, the host does not wait, and a reader queued before the copy sees the old bytes); the source read
at the call; a source an offloaded D2H still writes; another current stream; two host threads at once. (A CUDA
graph capture, which the inline path leaves to torch: ``test_cc_sync.py::test_capture_leaves_copies_alone``.)
"""

from __future__ import annotations

import threading

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 16, 47, 48, 49, 255, 256, 257, 495, 496, 497, 1000, 2048, 4079, 4080)


def _random_bytes(torch, n: int, pinned: bool):
    gen = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return host.pin_memory() if pinned else host


@pytest.mark.parametrize("pinned", [True, False])
def test_every_size_class_is_bit_exact_both_forms(emulated_cc, pinned):
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.synchronize()
    before = emulated_cc.stats().inlined
    calls = 0
    for n in SIZES:
        host = _random_bytes(torch, n, pinned)
        up = host.to(dev, non_blocking=True)
        into = torch.full((n,), 7, dtype=torch.uint8, device=dev)
        into.copy_(host, non_blocking=True)
        calls += 2
        torch.cuda.synchronize()
        assert torch.equal(up.cpu(), host), n
        assert torch.equal(into.cpu(), host), n
        assert up.shape == host.shape and up.dtype == host.dtype and up.device == dev
    for dtype, n in ((torch.int64, 1), (torch.int64, 510), (torch.float32, 1020), (torch.bfloat16, 2040),
                     (torch.bool, 333), (torch.complex64, 3)):
        raw = _random_bytes(torch, n * torch.empty((), dtype=dtype).element_size(), pinned)
        host = raw.view(dtype) if dtype is not torch.bool else (raw % 2).bool()
        up = host.to(dev, non_blocking=True)
        calls += 1
        torch.cuda.synchronize()
        assert torch.equal(up.cpu().view(torch.uint8), host.view(torch.uint8)), dtype
    assert emulated_cc.stats().inlined == before + calls


def test_a_4081_byte_upload_is_staged_not_inlined(emulated_cc, cycles_per_ms):
    import torch

    dev = torch.device("cuda", 0)
    host = _random_bytes(torch, 4081, True)
    torch.cuda._sleep(cycles_per_ms * 5)
    stats = emulated_cc.stats()
    up = host.to(dev, non_blocking=True)
    after = emulated_cc.stats()
    assert after.inlined == stats.inlined and after.staged == stats.staged + 1
    torch.cuda.synchronize()
    assert torch.equal(up.cpu(), host)


@pytest.mark.parametrize("nbytes", [4, 8, 1000])  # 4 and 8: one stream memory op (cuStreamWriteValue); 1000: the kernel
def test_behind_queued_work_the_host_goes_on_and_stream_order_holds(emulated_cc, cycles_per_ms, nbytes):
    """current : [sleep 30 ms] [old <- dst] [K: dst <- new bytes] [after <- dst]; the host returns at once."""
    import torch

    dev = torch.device("cuda", 0)
    dst = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    original = dst.clone()
    host = _random_bytes(torch, nbytes, True)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles_per_ms * 30)
    queued = torch.cuda.Event()
    queued.record()
    old = dst.clone()  # a reader queued before the copy
    dst.copy_(host, non_blocking=True)
    up = host.to(dev, non_blocking=True)
    after = dst.clone()
    assert queued.query() is False, "the host waited for the queued work"
    torch.cuda.synchronize()
    assert torch.equal(old, original)
    assert torch.equal(after.cpu(), host) and torch.equal(up.cpu(), host)
    assert dst._version >= 1


class _CountingDriver:
    """The loaded driver's quick library, counting the stream memory ops the inline path makes (the rest passes)."""

    def __init__(self, quick):
        self._quick = quick
        self.memops = {32: 0, 64: 0}

    def cuStreamWriteValue32_v2(self, *args):
        self.memops[32] += 1
        return self._quick.cuStreamWriteValue32_v2(*args)

    def cuStreamWriteValue64_v2(self, *args):
        self.memops[64] += 1
        return self._quick.cuStreamWriteValue64_v2(*args)

    def __getattr__(self, name):
        return getattr(self._quick, name)


def test_word_sized_uploads_into_aligned_and_unaligned_views_are_bit_exact(emulated_cc, cycles_per_ms,
                                                                           monkeypatch):
    """A position or token id (one int64, one int32) into a fresh tensor, into the middle of a buffer (aligned:
    a stream memory op; 4 bytes off for an int64 pair of int32s: the kernel), behind queued work and read back
    after later kernels on the same stream, with fresh random values. The H200 takes 64-bit memory ops, so the
    aligned ones must be word writes: the memory ops made are counted."""
    import torch

    dev = torch.device("cuda", 0)
    from syncless._core import libcuda
    from syncless.cc import _inline_h2d

    torch.ones(1, dtype=torch.int64).pin_memory().to(dev, non_blocking=True)  # the module loads at the first upload
    assert _inline_h2d._WORD_WRITES.get(0) is True, "cuda:0 should take 64-bit stream memory ops (an H200 does)"
    quick, blocking = libcuda.libraries()
    counting = _CountingDriver(quick)
    monkeypatch.setattr(libcuda, "LOADED", [(counting, blocking)])
    for dtype in (torch.int64, torch.int32, torch.float64, torch.float32):
        width = torch.empty((), dtype=dtype).element_size()
        raw = _random_bytes(torch, 3 * width, True)
        host = raw.view(dtype)
        buffer = torch.zeros(6, dtype=dtype, device=dev)
        torch.cuda._sleep(cycles_per_ms * 5)
        one = host[1:2].to(dev, non_blocking=True)  # 4 or 8 bytes of a pinned block
        buffer[3:4].copy_(host[2:3], non_blocking=True)  # aligned view
        doubled = one * 2  # a later kernel on the same stream reads the write
        torch.cuda.synchronize()
        assert torch.equal(one.cpu().view(torch.uint8), host[1:2].view(torch.uint8)), dtype
        assert torch.equal(buffer[3:4].cpu().view(torch.uint8), host[2:3].view(torch.uint8)), dtype
        if not dtype.is_floating_point:  # (random bits as a float may be a NaN, whose payload the GPU may change)
            assert torch.equal(doubled.cpu(), host[1:2] * 2), dtype
    assert counting.memops == {32: 4, 64: 4}, counting.memops  # two aligned uploads per dtype, each one memory op
    pairs = torch.zeros(4, dtype=torch.int32, device=dev)
    host = _random_bytes(torch, 8, True).view(torch.int32)
    pairs[1:3].copy_(host, non_blocking=True)  # 8 bytes at a 4-byte offset: not 8-aligned, the kernel writes it
    torch.cuda.synchronize()
    assert torch.equal(pairs[1:3].cpu(), host) and int(pairs[0]) == 0 and int(pairs[3]) == 0
    assert counting.memops == {32: 4, 64: 4}, counting.memops  # the unaligned one was no memory op
    assert _inline_h2d._WORD_WRITES.get(0) is True  # none was refused


def test_the_source_is_read_at_the_call(emulated_cc, cycles_per_ms):
    """As under CC (the copy has finished when its call returns): the host may rewrite its buffer at once."""
    import torch

    dev = torch.device("cuda", 0)
    host = _random_bytes(torch, 64, True)
    expected = host.clone()
    torch.cuda._sleep(cycles_per_ms * 20)
    up = host.to(dev, non_blocking=True)
    host.zero_()
    torch.cuda.synchronize()
    assert torch.equal(up.cpu(), expected)


def test_a_source_an_offloaded_copy_still_writes_gets_its_bytes(emulated_cc, cycles_per_ms):
    """A token read back on a D2H stream (offloaded, behind 30 ms of work) and uploaded at once: the upload waits
    for the job on the host and carries the read-back bytes."""
    import torch

    dev = torch.device("cuda", 0)
    tokens = torch.randint(0, 1 << 40, (8,), dtype=torch.int64, device=dev)
    d = emulated_cc.new_d2h_stream(dev)
    torch.cuda._sleep(cycles_per_ms * 30)
    d.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(d):
        back = tokens.to("cpu", non_blocking=True)
    up = back.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(up, tokens)
    emulated_cc.close_d2h_stream(d)


def test_another_current_stream_orders_the_kernel_there(emulated_cc, cycles_per_ms):
    import torch

    dev = torch.device("cuda", 0)
    side = torch.cuda.Stream(dev)
    dst = torch.zeros(256, dtype=torch.uint8, device=dev)
    host = _random_bytes(torch, 256, True)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles_per_ms * 20)
        dst.copy_(host, non_blocking=True)
        seen = dst.clone()
    assert torch.equal(torch.zeros_like(dst), dst)  # on the default stream: not yet written (side is sleeping)
    side.synchronize()
    assert torch.equal(seen.cpu(), host)


def test_two_threads_upload_at_once(emulated_cc):
    import torch

    dev = torch.device("cuda", 0)
    problems = []

    def run(seed: int):
        try:
            torch.cuda.set_device(dev)
            gen = torch.Generator().manual_seed(seed)
            for step in range(300):
                n = int(torch.randint(1, 4081, (), generator=gen))
                host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).pin_memory()
                up = host.to(dev, non_blocking=True)
                torch.cuda.current_stream().synchronize()
                if not torch.equal(up.cpu(), host):
                    problems.append((seed, step, n))
        except Exception as err:  # noqa: BLE001 - reported below
            problems.append(repr(err))

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not problems


def test_autograd_and_a_dtype_change_take_the_general_path(emulated_cc):
    import torch

    dev = torch.device("cuda", 0)
    before = emulated_cc.stats().inlined
    leaf = torch.randn(8, requires_grad=True)
    up = leaf.to(dev, non_blocking=True)
    up.sum().backward()
    assert up.grad_fn is not None and torch.equal(leaf.grad, torch.ones(8))
    into = torch.zeros(8, dtype=torch.float64, device=dev)
    into.copy_(torch.randn(8), non_blocking=True)
    assert emulated_cc.stats().inlined == before


def test_forward_mode_tangents_are_carried_as_torch_carries_them(emulated_cc):
    """Inside a dual level a tensor may carry a tangent with ``requires_grad`` False: only torch's copy carries it."""
    import torch
    import torch.autograd.forward_ad as fwAD

    dev = torch.device("cuda", 0)
    primal, tangent = torch.randn(3), torch.randn(3)
    with fwAD.dual_level():
        dual = fwAD.make_dual(primal, tangent)
        up = dual.to(dev, non_blocking=True)
        into = fwAD.make_dual(torch.zeros(3, device=dev), torch.zeros(3, device=dev))
        into.copy_(dual, non_blocking=True)
        torch.cuda.synchronize()
        for result in (up, into):
            unpacked = fwAD.unpack_dual(result)
            assert torch.equal(unpacked.primal.cpu(), primal)
            assert unpacked.tangent is not None and torch.equal(unpacked.tangent.cpu(), tangent)


def test_a_nested_tensors_copy_is_torchs_own(emulated_cc):
    """A nested tensor reports a strided layout but has no shape to compare: the check asks first, torch copies."""
    import torch

    dev = torch.device("cuda", 0)
    parts = [torch.randn(2, 3), torch.randn(4, 3)]
    with torch.cuda.device(dev):
        src = torch.nested.nested_tensor(parts)
        dst = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)]).to(dev)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    for got, want in zip(dst.unbind(), parts):
        assert torch.equal(got.cpu(), want)

"""Issue 33 on a GPU: a DataLoader with worker processes under ``install()`` while a copy is pending, and the fast
lane's offload and upload giving torch's bytes with fresh random data.

Every test runs under emulated CC with the shim (``emulated_cc``). ``LATE_MS`` of sleep on the D2H stream in
front of a copy keeps an offloaded copy pending while the rest of the test runs.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

LATE_MS = 200


class _Batches:
    """A map-style dataset of numpy arrays (the default collate turns them into tensors with torch.as_tensor in
    each worker process, after the fork)."""

    def __init__(self, n: int, seed: int):
        self.rows = np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        return self.rows[index]


def test_a_dataloader_with_worker_processes_runs_while_a_copy_is_pending(emulated_cc, cycles_per_ms):
    """Item 6: a worker forked while an offloaded copy was pending inherited the pending count and no worker
    thread; its ``torch.as_tensor`` (the default collate of numpy arrays) then touched CUDA in the child, which
    torch refuses after a fork. The at-fork handler forgets the parent's copies in the child."""
    import torch

    dev = torch.device("cuda", 0)
    src = torch.randn(1 << 12, device=dev)
    expected = src.cpu()
    d = emulated_cc.new_d2h_stream(dev)
    d.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(d):
        torch.cuda._sleep(cycles_per_ms * LATE_MS)
        out = src.to("cpu", non_blocking=True)  # pending while the workers start
    ready = torch.cuda.Event()
    ready.record(d)
    from syncless.cc import _d2h

    assert _d2h.pending()
    # Garbage earlier tests left in reference cycles (dynamo's caches hold events) must not be collected in a forked
    # worker: destroying a CUDA event in a forked child aborts it (torch's own hazard with fork, shim or not; run 83
    # hit it once the compiled-region tests ran before this one).
    import gc

    gc.collect()
    data = _Batches(64, seed=int(torch.randint(0, 1 << 30, ()).item()))
    loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2,
                                         multiprocessing_context="fork", timeout=60)
    batches = list(loader)
    assert torch.equal(torch.cat(batches), torch.from_numpy(data.rows))
    ready.synchronize()
    assert torch.equal(out, expected)
    emulated_cc.close_d2h_stream(d)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "uint8", "complex64"])
def test_the_fast_lane_moves_torchs_bytes_both_ways(emulated_cc, cycles_per_ms, dtype):
    """The lane's offload (``x.to("cpu", non_blocking=True)`` on a D2H stream) and upload
    (``h.to("cuda", non_blocking=True)``): fresh random data of each dtype, bit-exact against torch's own copy,
    the offload read one step late after a slow producer, the upload into a buffer the host rewrites next."""
    import torch

    dev = torch.device("cuda", 0)
    kind = getattr(torch, dtype)
    gen = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    source = torch.randint(0, 255, (4096,), device=dev, generator=gen, dtype=torch.int64).to(kind) \
        if not kind.is_floating_point and not kind.is_complex else torch.randn(4096, device=dev, generator=gen).to(kind)
    producer = torch.cuda.Stream(dev)
    x = torch.empty_like(source)
    d = emulated_cc.new_d2h_stream(dev)
    producer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        torch.cuda._sleep(cycles_per_ms * 30)
        x.copy_(source)
    d.wait_stream(producer)
    before = emulated_cc.stats().offloaded
    with torch.cuda.stream(d):
        host = x.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(d)
    assert emulated_cc.stats().offloaded == before + 1 and host.is_pinned() and host._version == 0
    with torch.cuda.stream(d):
        x.zero_()  # on the D2H stream right after the call: torch orders it after the copy's read
    ready.synchronize()
    assert torch.equal(host.view(torch.uint8), source.cpu().view(torch.uint8))
    for queued_ms in (30, 0):  # staged behind queued work; torch's own copy on an idle stream
        pinned = source.cpu().pin_memory()
        torch.cuda.synchronize()
        stats_before = emulated_cc.stats()
        if queued_ms:
            torch.cuda._sleep(cycles_per_ms * queued_ms)
        up = pinned.to(dev, non_blocking=True)
        pinned.zero_()  # the host rewrites its buffer right after the call: under CC the copy had finished
        stats = emulated_cc.stats()
        if queued_ms:
            assert stats.staged == stats_before.staged + 1
        else:
            assert stats.left_alone.get("idle_stream", 0) == stats_before.left_alone.get("idle_stream", 0) + 1
        assert torch.equal(up.view(torch.uint8).cpu(), source.view(torch.uint8).cpu())
    emulated_cc.close_d2h_stream(d)


def test_an_empty_tensor_goes_through_the_lane_both_ways(emulated_cc, cycles_per_ms):
    """No memory to copy: the snapshot makes no device copy (a null data pointer), the job no transfer."""
    import torch

    dev = torch.device("cuda", 0)
    d = emulated_cc.new_d2h_stream(dev)
    before = emulated_cc.stats().offloaded
    with torch.cuda.stream(d):
        torch.cuda._sleep(cycles_per_ms * 5)  # queued work on d: offloaded, not read back at once
        out = torch.empty(0, 3, device=dev).to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(d)
    ready.synchronize()
    assert out.shape == (0, 3) and out.device.type == "cpu" and emulated_cc.stats().offloaded == before + 1
    up = torch.empty(0, dtype=torch.int64).pin_memory().to(dev, non_blocking=True)
    assert up.shape == (0,) and up.is_cuda
    emulated_cc.close_d2h_stream(d)


def test_a_small_readback_from_an_idle_d2h_stream_is_torchs_own_copy(emulated_cc, cycles_per_ms):
    """The decode loop's token readback when the compute stream has drained: nothing to hide, so torch's own copy
    (under CC the transfer alone) instead of an offload; with work queued on the D2H stream, or a copy of it still
    pending, or 4 KiB and more, it is offloaded. Fresh random tokens, bit-exact each time."""
    import torch

    dev = torch.device("cuda", 0)
    d = emulated_cc.new_d2h_stream(dev)

    def read_back(n, queued_ms=0):
        tokens = torch.randint(-(1 << 62), 1 << 62, (n,), dtype=torch.int64, device=dev)
        d.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        before = emulated_cc.stats()
        with torch.cuda.stream(d):
            if queued_ms:
                torch.cuda._sleep(cycles_per_ms * queued_ms)
            host = tokens.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(d)
        after = emulated_cc.stats()
        ready.synchronize()
        assert torch.equal(host, tokens.cpu()) and host.is_pinned() and host._version == 0
        return (after.offloaded - before.offloaded,
                after.left_alone.get("idle_stream", 0) - before.left_alone.get("idle_stream", 0))

    assert read_back(8) == (0, 1)
    assert read_back(511) == (0, 1)
    assert read_back(512) == (1, 0)  # 4 KiB
    assert read_back(8, queued_ms=20) == (1, 0)
    # A copy of d still pending: the next one queues behind it instead of landing first, though d is idle.
    from syncless.cc import _worker

    first = torch.randint(0, 1 << 30, (8,), dtype=torch.int64, device=dev)
    second = torch.randint(0, 1 << 30, (8,), dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    stats = emulated_cc.stats()
    grace, _worker.GRACE_S = _worker.GRACE_S, 30.0  # nobody runs the job until it is waited for
    try:
        with torch.cuda.stream(d):
            torch.cuda._sleep(cycles_per_ms * 10)
            a = first.to("cpu", non_blocking=True)
        while not torch._C._CudaStreamBase.query(d):  # torch's own query: d has drained (the job has not run)
            time.sleep(0.001)
        with torch.cuda.stream(d):
            b = second.to("cpu", non_blocking=True)
    finally:
        _worker.GRACE_S = grace
    assert emulated_cc.stats().offloaded == stats.offloaded + 2
    d.synchronize()
    assert torch.equal(a, first.cpu()) and torch.equal(b, second.cpu())
    emulated_cc.close_d2h_stream(d)

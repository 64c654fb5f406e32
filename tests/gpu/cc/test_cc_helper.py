"""The D2H helper process (``SYNCLESS_CC_D2H_HELPER=1``) on a GPU, under emulated CC with the shim, and issue 33
item 7 (an event opened from an IPC handle carries no cover).

Fresh random data each run; every readback is compared bit for bit with torch's own copy of the same bytes, read
after slow producers so that the helper must wait for each slot's ready event rather than read the slot early.
"""

from __future__ import annotations

import os
import signal

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


@pytest.fixture
def helper_cc(monkeypatch):
    """The shim under emulated CC with the D2H helper on, GPU 0's helper ready; everything restored after."""
    import syncless.cc as cc
    from syncless.cc import _helper

    cc.uninstall()
    cc.reset_stats()
    monkeypatch.setenv("SYNCLESS_CC_D2H_HELPER", "1")
    cc.install("emulate")
    assert _helper.wait_ready(0), "the D2H helper process did not start (see the warning in the log)"
    yield cc
    cc.uninstall()
    assert not _helper._HELPERS, "uninstall() left a helper running"


def _seed(torch) -> int:
    return int(torch.randint(0, 1 << 30, ()).item())


def test_readbacks_through_the_helper_are_torchs_bytes(helper_cc, cycles_per_ms):
    """Two D2H streams, 400 steps of 1-3 readbacks each (1 byte to 64 KiB, several dtypes), slow producers on a
    compute stream, each read one step late through its event: every byte equals torch's own copy."""
    import torch

    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(_seed(torch))
    streams = [helper_cc.new_d2h_stream(dev), helper_cc.new_d2h_stream(dev)]
    compute = torch.cuda.current_stream(dev)
    kinds = [torch.uint8, torch.int64, torch.float32, torch.bfloat16]
    pending = []
    checked = 0
    for step in range(400):
        if step % 25 == 0:
            torch.cuda._sleep(cycles_per_ms * 5)  # a slow producer ahead of this step's writes
        batch = []
        for k in range(1 + step % 3):
            kind = kinds[(step + k) % len(kinds)]
            n = int(torch.randint(1, 65536 // torch.empty((), dtype=kind).element_size() + 1, (1,)).item())
            src = torch.randint(0, 250, (n,), device=dev, generator=gen, dtype=torch.int64).to(kind)
            d = streams[(step + k) % 2]
            d.wait_stream(compute)
            with torch.cuda.stream(d):
                host = src.to("cpu", non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(d)
                src.add_(1)  # overwritten on D after the call (torch orders it after the copy): the bytes before
            batch.append((host, ready, src))
        for host, ready, src in pending:
            ready.synchronize()
            assert torch.equal(host, (src - 1).cpu()), f"step {step}: the helper's readback differs from torch's"
            checked += 1
        pending = batch
    for host, ready, src in pending:
        ready.synchronize()
        assert torch.equal(host, (src - 1).cpu())
        checked += 1
    stats = helper_cc.stats()
    assert stats.to_helper >= checked * 9 // 10, f"only {stats.to_helper} of {checked} copies went to the helper"
    for d in streams:
        helper_cc.close_d2h_stream(d)


def test_a_killed_helper_fails_its_copies_and_later_copies_stay_here(helper_cc, cycles_per_ms):
    """SIGKILL the helper while a copy waits behind 300 ms of GPU work: the covering synchronize raises
    D2HCopyError (caused by D2HHelperGoneError) rather than hand over unwritten bytes, and the copies after it are
    made in this process, right."""
    import torch

    from syncless.cc import _helper
    from syncless.cc._helper import D2HHelperGoneError
    from syncless.cc._worker import D2HCopyError

    dev = torch.device("cuda", 0)
    d = helper_cc.new_d2h_stream(dev)
    src = torch.arange(1000, device=dev, dtype=torch.int64)
    with torch.cuda.stream(d):
        torch.cuda._sleep(cycles_per_ms * 300)
        host = src.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(d)
    assert helper_cc.stats().to_helper == 1
    helper = _helper._HELPERS[0]
    os.kill(helper.process.pid, signal.SIGKILL)
    with pytest.raises(D2HCopyError) as caught:
        ready.synchronize()
    assert isinstance(caught.value.__cause__, D2HHelperGoneError) or "helper" in str(caught.value)
    gen = torch.Generator(device=dev).manual_seed(_seed(torch))
    again = torch.randint(0, 1 << 40, (333,), device=dev, generator=gen)
    with torch.cuda.stream(d):
        later = again.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(d)
    ready.synchronize()
    assert torch.equal(later, again.cpu())
    assert helper_cc.stats().to_helper == 1, "a copy went to the dead helper"
    helper_cc.close_d2h_stream(d)


def test_uninstall_stops_the_helper_and_install_starts_a_new_one(helper_cc):
    import torch

    from syncless.cc import _helper

    dev = torch.device("cuda", 0)
    first = _helper._HELPERS[0].process
    helper_cc.uninstall()
    assert first.wait(5) == 0, "the helper did not exit cleanly at uninstall()"
    helper_cc.install("emulate")
    assert _helper.wait_ready(0)
    assert _helper._HELPERS[0].process.pid != first.pid
    d = helper_cc.new_d2h_stream(dev)
    src = torch.randn(64, device=dev)
    with torch.cuda.stream(d):
        host = src.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(d)
    ready.synchronize()
    assert torch.equal(host, src.cpu())
    helper_cc.close_d2h_stream(d)


_OPEN_AND_WAIT = """
import sys, torch
handle = bytes.fromhex(sys.argv[1])
event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), handle)
event.synchronize()
print("opened-and-synchronized", getattr(event, "_syncless_d2h_seq", None))
"""


def test_an_event_opened_from_an_ipc_handle_carries_no_cover_and_the_recipe_holds(emulated_cc, cycles_per_ms):
    """Item 7 (documented, docs/cc.md "Failures"): an event opened from another event's IPC handle, in another
    process (this driver refuses to open one in the process that made it), is a new object without the cover
    stamp, so nothing ties its synchronize to the offloaded copy. The original carries the cover, and the docs'
    recipe (synchronize the original before handing the handle over) gives torch's bytes; the opened event then
    waits for nothing more."""
    import subprocess
    import sys

    import torch

    from syncless.cc import _sync_patches

    dev = torch.device("cuda", 0)
    d = emulated_cc.new_d2h_stream(dev)
    gen = torch.Generator(device=dev).manual_seed(_seed(torch))
    src = torch.randint(0, 1 << 40, (4096,), device=dev, generator=gen)
    with torch.cuda.stream(d):
        torch.cuda._sleep(cycles_per_ms * 50)
        host = src.to("cpu", non_blocking=True)
        original = torch.cuda.Event(interprocess=True)
        original.record(d)
    assert getattr(original, _sync_patches._MARK, None), "the recorded interprocess event carries no cover"
    original.synchronize()  # the recipe: the covering synchronize, before the handle is handed over
    assert torch.equal(host, src.cpu())
    child = subprocess.run([sys.executable, "-c", _OPEN_AND_WAIT, original.ipc_handle().hex()],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "opened-and-synchronized None" in child.stdout, child.stdout
    emulated_cc.close_d2h_stream(d)

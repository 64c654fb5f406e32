"""The seed's any-event rule on a GPU (issue 24 item 3): every event recorded after an offloaded copy's call covers it.

Under CC without the shim, a host<->device copy has finished when its call returns, so any event recorded after
it, on any stream, "is after" the copy. Each test queues a long sleep on the D2H stream in front of the offloaded
copy, so the copy lands ~``LATE_MS`` later; an event recorded afterwards on an idle ordinary stream fires at once
on the GPU. Before the fix only events recorded on the D2H stream were stamped: these tests read the poisoned
destination (NaN) after the event's synchronize / a True query / a wait on it.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

N = 1 << 16
LATE_MS = 60


def _late_copy(cc, cycles_per_ms):
    """Offload a D2H of fresh data behind ``LATE_MS`` of work on a D2H stream; return (dst, expected)."""
    import torch

    dev = torch.device("cuda", 0)
    d2h = cc.new_d2h_stream(dev)
    expected = torch.randn(N)
    src = expected.to(dev)  # blocking: on the GPU before anything below
    dst = torch.full((N,), float("nan")).pin_memory()
    d2h.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(d2h):
        torch.cuda._sleep(cycles_per_ms * LATE_MS)
        dst.copy_(src, non_blocking=True)  # offloaded: returns at once, lands after the sleep
    assert cc.stats().offloaded == 1
    return dst, expected


def _event_after(kind, stream):
    """An event of ``kind`` recorded on ``stream`` (idle, or the current stream: nothing queued there)."""
    import torch

    if kind == "cuda":
        event = torch.cuda.Event()
        event.record(stream)
    elif kind == "torch":
        event = torch.Event(device="cuda")
        event.record(stream)
    elif kind == "record_event":
        event = stream.record_event()
    else:  # the current stream's own, recorded without a stream argument
        with torch.cuda.stream(stream):
            event = torch.cuda.Event()
            event.record()
    return event


KINDS = ["cuda", "torch", "record_event", "current"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["current", "other"])
def test_synchronize_of_any_later_event_covers_the_copy(emulated_cc, cycles_per_ms, kind, where):
    import torch

    dst, expected = _late_copy(emulated_cc, cycles_per_ms)
    stream = torch.cuda.current_stream() if where == "current" else torch.cuda.Stream()
    event = _event_after(kind, stream)
    event.synchronize()
    assert torch.equal(dst, expected), "an event recorded after the copy returned before the copy landed"


@pytest.mark.parametrize("kind", KINDS)
def test_query_of_any_later_event_is_false_until_the_copy_lands(emulated_cc, cycles_per_ms, kind):
    import time

    import torch

    dst, expected = _late_copy(emulated_cc, cycles_per_ms)
    event = _event_after(kind, torch.cuda.Stream())
    assert event.query() is False, "query() said True while the copy it covers was ~60 ms away"
    deadline = time.monotonic() + 30
    while not event.query():
        assert time.monotonic() < deadline
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("how", ["wait_event", "event_wait", "wait_stream"])
def test_a_wait_on_any_later_event_covers_the_copy(emulated_cc, cycles_per_ms, how):
    """``P.wait_event(e)``, ``e.wait(P)`` and ``P.wait_stream(S)`` (which records one on S) wait on the host for
    the copies the event covers, before the GPU wait is enqueued."""
    import torch

    dst, expected = _late_copy(emulated_cc, cycles_per_ms)
    producer, waiter = torch.cuda.Stream(), torch.cuda.Stream()
    if how == "wait_stream":
        waiter.wait_stream(producer)
    else:
        event = _event_after("cuda", producer)
        if how == "wait_event":
            waiter.wait_event(event)
        else:
            event.wait(waiter)
    assert torch.equal(dst, expected)


def test_an_event_recorded_before_the_copy_stays_torchs_own(emulated_cc, cycles_per_ms):
    """Today's behaviour otherwise: an event recorded before the copy's call does not wait for it."""
    import torch

    event = _event_after("cuda", torch.cuda.Stream())
    dst, _ = _late_copy(emulated_cc, cycles_per_ms)
    event.synchronize()
    assert event.query() is True
    assert bool(torch.isnan(dst).all()), "the old event waited for a copy issued after it"
    torch.cuda.synchronize()

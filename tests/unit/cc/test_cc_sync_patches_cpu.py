"""The patched event record on a CPU-only torch: recorded where the caller asked, stamped with the copies so far."""

import pytest
import torch

import syncless.cc as cc
from syncless.cc import _sync_patches
from syncless.cc._worker import OrderedWorker


@pytest.fixture(autouse=True)
def _clean():
    yield
    cc.uninstall()


def _worker_with_submitted(n):
    """A worker that has run ``n`` copies (all finished), so that an uninstall finds nothing to wait for."""
    worker = OrderedWorker("test-marks")
    worker._submitted = worker._completed = worker._settled = n
    return worker


def _a_cuda_event():
    """A torch.cuda.Event that is never recorded (making one touches no GPU)."""
    try:
        return torch.cuda.Event()
    except RuntimeError:  # a CPU-only torch: its torch.cuda.Event is a placeholder that refuses to be made
        return object.__new__(torch.cuda.Event)


def _one_d2h_stream(monkeypatch, last_job, worker=None):
    """Make one stand-in stream a D2H stream whose last offloaded copy is ``last_job``; return (stream, worker)."""
    from syncless.cc import _d2h

    d2h = object()
    record = _d2h._D2HStream(d2h, last_job, worker or _worker_with_submitted(last_job))
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 1): record})
    monkeypatch.setattr(_d2h, "lookup", lambda stream: record if stream is d2h else None)
    return d2h, record.worker


@pytest.fixture
def no_unraised_failures():
    """No failure left by another test waits to be raised (it would keep every record stamping)."""
    from syncless.cc import _worker

    saved = _worker.UNRAISED[0]
    _worker.UNRAISED[0] = 0
    yield
    _worker.UNRAISED[0] = saved


def test_event_record_goes_to_the_stream_asked_for_and_any_stream_stamps_it(monkeypatch, no_unraised_failures):
    """While a copy is pending, an event recorded on any stream covers it (the seed's rule, issue 24 item 3)."""
    from syncless.cc import _d2h

    recorded_on = []
    record = _sync_patches._wrap_event_record(lambda event, stream=None: recorded_on.append(stream))
    d2h, worker = _one_d2h_stream(monkeypatch, last_job=5, worker=_worker_with_submitted(7))
    worker._completed = worker._settled = 4  # job 5 (D's last) is still pending
    monkeypatch.setattr(_d2h, "_PENDING", [1])
    monkeypatch.setattr(_d2h, "_COVER", [((worker, 7),)])
    other = object()
    stamps = []
    for stream in (d2h, other, None):
        event = _a_cuda_event()
        record(event, stream)
        stamps.append(getattr(event, _sync_patches._MARK, None))
    assert stamps == [((worker, 7),)] * 3  # an ordinary stream's event, and the current stream's, cover it too
    assert recorded_on == [d2h, other, None]  # nothing redirected: torch's own semantics
    event = _a_cuda_event()
    record(event, other)
    monkeypatch.setattr(_d2h, "_PENDING", [0])
    record(event, other)  # re-recorded once nothing is pending: the old stamp goes
    assert getattr(event, _sync_patches._MARK, None) is None
    worker._completed = worker._settled = 7  # done: the teardown's uninstall finds nothing to wait for


def test_torch_event_subclass_records_where_asked(monkeypatch):
    seen = []

    class FakeTorchEvent:  # stands in for the C torch.Event, whose record needs a GPU
        def record(self, stream=None):
            seen.append(stream)

    from syncless.cc import _d2h

    event_type = _sync_patches._wrap_torch_event(FakeTorchEvent)
    d2h, worker = _one_d2h_stream(monkeypatch, last_job=3)
    monkeypatch.setattr(_d2h, "_PENDING", [1])
    monkeypatch.setattr(_d2h, "_COVER", [((worker, 3),)])
    event = event_type()
    event.record(d2h)
    assert seen == [d2h]
    assert getattr(event, _sync_patches._MARK) == ((worker, 3),)


def test_ordering_goes_through_the_event_and_stream_methods_stay_torchs():
    """wait_stream/record_event/wait_event stay torch's own; they reach the patched Event.record and Event.wait."""
    names = {(owner, name) for owner, name, _ in _sync_patches.patch_targets()}
    for name in ("wait_stream", "wait_event", "record_event"):
        assert (torch.cuda.Stream, name) not in names
    assert (torch.cuda.Event, "record") in names and (torch.cuda.Event, "wait") in names


def test_a_wait_on_a_stamped_event_waits_on_the_host_before_the_gpu_wait(monkeypatch):
    order = []

    class Worker:
        def is_pending(self, seq):
            return seq == 4

        def wait_for(self, seq, timeout_s=None):
            order.append(("host waits for job", seq))

        def wait_and_raise(self, seq, timeout_s=None, any_thread=False):
            pass  # (waited for above: nothing failed)

    wait = _sync_patches._wrap_event_wait(lambda event, stream=None: order.append(("gpu wait", stream)))
    stamped, plain = _a_cuda_event(), _a_cuda_event()
    setattr(stamped, _sync_patches._MARK, ((Worker(), 4),))
    wait(stamped, "P")
    wait(plain, "P")
    assert order == [("host waits for job", 4), ("gpu wait", "P"), ("gpu wait", "P")]


def _failed_worker():
    """A worker whose job #1 failed on this thread (finished, its error not raised yet)."""
    worker = OrderedWorker("test-failed")

    def fail():
        raise RuntimeError("bf16 temporary: out of memory (stand-in)")

    worker.submit(fail, "copy")
    worker.wait_for(1)
    return worker


@pytest.mark.parametrize("how", ["query", "wait", "synchronize"])
def test_every_covering_call_on_the_issuing_thread_raises_a_failed_copy(how):
    """Issue 27 item 4: ``query()`` said True for a failed job, and ``e.wait(P)`` / ``P.wait_event(e)`` waited with
    errors kept back; each now raises the failure on the thread that issued the copy."""
    from syncless.cc._worker import D2HCopyError

    worker = _failed_worker()
    try:
        event = _a_cuda_event()
        setattr(event, _sync_patches._MARK, ((worker, 1),))
        call = {
            "query": lambda: _sync_patches._wrap_event_query(lambda e: True)(event),
            "wait": lambda: _sync_patches._wrap_event_wait(lambda e, stream=None: None)(event, "P"),
            "synchronize": lambda: _sync_patches._wrap_event_synchronize(lambda e: None)(event),
        }[how]
        with pytest.raises(D2HCopyError, match="out of memory"):
            call()
        assert worker.failures_pending() == 0
    finally:
        worker.shutdown(5.0)

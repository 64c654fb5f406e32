"""How offloaded copies' failures reach the threads that wait (CPU stand-ins for the jobs; session 25's review).

- A wait that covers several D2H streams waits for every one of them before it raises a failure on one.
- Two streams' failures covered by one wait are raised together, once.
- A staged upload of host memory a failed copy was to write raises the failure once per thread, as any covering
  call does: it counts as had for that thread (its next covering wait and ``uninstall()`` do not raise it again),
  and an upload by a thread that already had it goes on.
"""

from __future__ import annotations

import threading

import pytest
import torch

from syncless.cc import _d2h, _host_writes
from syncless.cc._worker import D2HCopyError, OrderedWorker


def _fail(message):
    def job():
        raise RuntimeError(message)

    return job


@pytest.fixture
def workers():
    made = []

    def make(name):
        worker = OrderedWorker(name)
        made.append(worker)
        return worker

    _host_writes.clear()
    yield make
    _host_writes.clear()
    for worker in made:
        worker.shutdown(5.0)


def test_a_wait_covering_two_streams_waits_for_both_before_it_raises(workers):
    failing, slow = workers("D1"), workers("D2")
    failed = failing.submit(_fail("copy A failed"), "copy A", eager=False)
    failing.wait_for(failed)
    gate, landed = threading.Event(), []
    in_flight = slow.submit(lambda: (gate.wait(10), landed.append(True)), "copy B", eager=True)
    timer = threading.Timer(0.3, gate.set)
    timer.start()
    try:
        with pytest.raises(D2HCopyError, match="copy A"):
            _d2h.wait_for_tickets([(failing, failed), (slow, in_flight)], raise_errors=True)
        assert landed == [True]  # the other stream's copy was waited for: its buffer may be read
        assert not slow.is_pending(in_flight)
    finally:
        gate.set()
        timer.join(5)


def test_failures_on_two_streams_covered_by_one_wait_are_raised_together_once(workers):
    first, second = workers("D1"), workers("D2")
    a = first.submit(_fail("A went wrong"), "copy A", eager=False)
    b = second.submit(_fail("B went wrong"), "copy B", eager=False)
    first.wait_for(a)
    second.wait_for(b)
    with pytest.raises(D2HCopyError) as raised:
        _d2h.wait_for_tickets([(first, a), (second, b)], raise_errors=True)
    text = str(raised.value)
    assert "copy A" in text and "copy B" in text and "A went wrong" in text
    _d2h.wait_for_tickets([(first, a), (second, b)], raise_errors=True)  # this thread had both: nothing more
    assert first.take_unreported() == [] and second.take_unreported() == []  # the issuer had them


def _failed_copy_into(worker, host):
    seq = worker.submit(_fail("copy into h failed"), "offloaded copy into h", eager=False)
    _host_writes.note_offloaded_d2h(host, (worker, seq))  # what _d2h._queue notes for the copy
    worker.wait_for(seq)
    return seq


def test_a_staged_upload_that_raises_a_failure_counts_as_the_thread_having_it(workers):
    worker = workers("D")
    host = torch.zeros(16)
    seq = _failed_copy_into(worker, host)
    with pytest.raises(D2HCopyError, match="copy into h"):
        _host_writes.order_after_pending_writes(None, host)  # a staged H2D of h
    worker.wait_and_raise(seq)  # this thread's next covering wait: had it already
    assert worker.take_unreported() == []  # uninstall() / close_d2h_stream() have nothing left to raise
    _host_writes.order_after_pending_writes(None, host)  # and the next upload of h goes on


def test_an_upload_by_a_thread_that_had_the_failure_goes_on(workers):
    worker = workers("D")
    host = torch.zeros(16)
    seq = _failed_copy_into(worker, host)
    with pytest.raises(D2HCopyError):
        worker.wait_and_raise(seq)  # the issuing thread's covering wait raised it
    _host_writes.order_after_pending_writes(None, host)  # had it: the upload is not refused a second time


def test_an_upload_by_another_thread_that_never_had_the_failure_raises_it(workers):
    worker = workers("D")
    host = torch.zeros(16)
    seq = _failed_copy_into(worker, host)
    with pytest.raises(D2HCopyError):
        worker.wait_and_raise(seq)  # the issuing thread had it
    _host_writes.order_after_pending_writes(None, host)  # and uploads the memory as it is
    seen = []

    def consumer():
        try:
            _host_writes.order_after_pending_writes(None, host)
            seen.append("no error")
        except D2HCopyError as err:
            seen.append(str(err).splitlines()[0])

    thread = threading.Thread(target=consumer)
    thread.start()
    thread.join(10)
    assert len(seen) == 1 and "offloaded copy into h" in seen[0]


def test_a_query_that_finds_a_copy_pending_has_its_queue_run_it_now(workers, monkeypatch):
    from types import SimpleNamespace

    from syncless.cc import _sync_patches, _worker

    monkeypatch.setattr(_worker, "GRACE_S", 600.0)  # unkicked, the queue's thread would wait this long for a waiter
    worker = workers("D")
    ran = threading.Event()
    seq = worker.submit(ran.set, "a small copy", eager=False)
    event = SimpleNamespace(**{_sync_patches._MARK: ((worker, seq),)})  # an event recorded after the copy
    assert _sync_patches._marked_pending(event)  # a poller's query(): False for now ...
    assert ran.wait(10)  # ... and the queue's thread runs the copy at once
    worker.wait_for(seq, timeout_s=10)
    assert not _sync_patches._marked_pending(event)


def test_an_interrupt_in_the_wait_for_one_stream_loses_no_failure_of_another(workers, monkeypatch):
    failing, slow = workers("D1"), workers("D2")
    failed = failing.submit(_fail("copy A failed"), "copy A", eager=False)
    failing.wait_for(failed)
    in_flight = slow.submit(lambda: None, "copy B", eager=False)
    real_wait = slow.wait_for

    def interrupted(seq, **kwargs):
        raise KeyboardInterrupt  # a Ctrl-C while this thread waits for the second stream

    monkeypatch.setattr(slow, "wait_for", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _d2h.wait_for_tickets([(failing, failed), (slow, in_flight)], raise_errors=True)
    monkeypatch.setattr(slow, "wait_for", real_wait)
    with pytest.raises(D2HCopyError, match="copy A"):  # not marked had by the wait that was cut short
        _d2h.wait_for_tickets([(failing, failed), (slow, in_flight)], raise_errors=True)

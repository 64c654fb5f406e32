"""The copy-engine transport's close() and abort() with stand-ins for the GPU (CPU only).

What is under test is the order of the real tear-down (``_teardown.Teardown``)
and the transport's own bookkeeping: close() resumes after an interrupt,
nothing shared is freed without a successful barrier, abort() is local and
leaves the GPU objects to a call that is still running.
"""

from __future__ import annotations

import threading
import time

import pytest

from syncless._core.errors import PeerTimeoutError, TransportClosedError, TransportFailedError
from syncless.pp import _copy_engine as ce
from syncless.pp import _faults
from syncless.pp._teardown import Teardown

BUFFER_NBYTES = 4096


class Ctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class Dog:
    """The watchdog's surface that close() and abort() use."""

    def __init__(self, idle=True):
        self.idle = idle
        self.interrupt_next_wait = False
        self.during_next_wait = None
        self.stops = []
        self.thread = threading.Thread(target=lambda: None)

    def pending(self):
        return 0 if self.idle else 1

    def wait_idle(self, deadline_s=None):
        during, self.during_next_wait = self.during_next_wait, None
        if during is not None:
            during()  # e.g. abort() from a signal handler that interrupted this wait
        if self.interrupt_next_wait:
            self.interrupt_next_wait = False
            raise KeyboardInterrupt
        return self.idle

    def stop(self, join=True, timeout_s=None):
        self.stops.append(join)


class Endpoint:
    """A metadata socket end (the real one is tested in test_meta_channel.py): records shutdown()."""

    def __init__(self):
        self.shut = False

    def shutdown(self):
        self.shut = True


class Parts:
    def __init__(self):
        self.meta_in, self.meta_out = Endpoint(), Endpoint()


class Finalizer:
    def __init__(self):
        self.detached = False

    def detach(self):
        self.detached = True


class Stages:
    def name(self, index=None):
        return "stage 1 (rank 1)"


def _transport(log, barrier_ok=True, idle=True):
    teardown = Teardown()
    teardown.shared(lambda: log.append("free buffer"), nbytes=BUFFER_NBYTES, what="buffer")
    teardown.barrier(lambda: log.append("barrier") or barrier_ok)
    teardown.local(lambda: log.append("destroy stream"))
    teardown.unmap(lambda: log.append("unmap peer"), what="peer buffer")
    transport = object.__new__(ce.CopyEngineTransport)
    transport.__dict__.update(
        _teardown=teardown, _drained=False, _gpu_idle=False, _in_call=False, _closed=False, _failure=None,
        _watchdog=Dog(idle), _ctx=Ctx(), _parts=Parts(), _finalizer=Finalizer(), _stages=Stages(),
        _timeout_s=3.0, _release=lambda: log.append("release waits"),
    )
    return transport


def test_a_clean_close_frees_everything_after_the_barrier_and_then_refuses_calls():
    log = []
    transport = _transport(log)
    transport.close()
    assert log == ["unmap peer", "destroy stream", "barrier", "free buffer"]
    assert transport.error is None and transport.leaked_nbytes == 0 and transport._finalizer.detached
    transport.close()  # once done, nothing more
    assert log.count("barrier") == 1
    with pytest.raises(TransportClosedError):
        transport._check_usable()


def test_a_close_interrupted_while_draining_is_finished_by_the_next():
    log = []
    transport = _transport(log)
    transport._watchdog.interrupt_next_wait = True
    with pytest.raises(KeyboardInterrupt):
        transport.close()
    assert log == []
    transport.close()
    assert log == ["unmap peer", "destroy stream", "barrier", "free buffer"]


def test_a_close_interrupted_at_its_barrier_point_resumes_and_enters_the_barrier_once():
    log = []
    transport = _transport(log)
    interrupts = ["close"]

    def hook(phase):
        if phase in interrupts:
            interrupts.remove(phase)
            raise KeyboardInterrupt

    _faults.install(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            transport.close()
        transport.close()
    finally:
        _faults.install(None)
    assert log == ["unmap peer", "destroy stream", "barrier", "free buffer"]


def test_a_failed_barrier_keeps_the_buffer_and_reports_it():
    log = []
    transport = _transport(log, barrier_ok=False)
    transport.close()
    assert "free buffer" not in log and transport.leaked_nbytes == BUFFER_NBYTES


def test_close_after_a_failure_releases_the_waits_first():
    log = []
    transport = _transport(log)
    transport._failure = PeerTimeoutError("step 4: the peer sent nothing")
    transport.close()
    assert log[0] == "release waits"


def test_a_gpu_that_never_went_idle_keeps_mappings_and_buffer():
    log = []
    transport = _transport(log, idle=False)
    transport.close()
    assert "unmap peer" not in log and "free buffer" not in log
    assert transport.leaked_nbytes == BUFFER_NBYTES


def test_abort_while_a_call_runs_only_stops_and_releases_and_close_finishes_without_barrier():
    log = []
    transport = _transport(log)
    transport._in_call = True  # a recv() blocked on another thread
    assert transport.abort() == 0
    assert log == ["release waits"]
    assert transport._parts.meta_in.shut and transport._parts.meta_out.shut
    assert isinstance(transport.error, TransportFailedError)
    transport._in_call = False
    transport.close()
    assert "barrier" not in log and "free buffer" not in log
    assert transport.leaked_nbytes == BUFFER_NBYTES
    with pytest.raises(TransportFailedError, match="aborted"):
        transport._check_usable()


def test_abort_when_idle_releases_what_is_local_at_once_and_is_idempotent():
    log = []
    transport = _transport(log)
    leaked = transport.abort()
    assert log == ["release waits", "unmap peer", "destroy stream"] and leaked == BUFFER_NBYTES
    assert transport.abort() == BUFFER_NBYTES and transport.close() is None
    assert log.count("destroy stream") == 1


def test_abort_keeps_the_error_that_came_first():
    transport = _transport([])
    first = PeerTimeoutError("step 2 timed out")
    transport._failure = first
    transport.abort()
    assert transport.error is first


def test_abort_during_the_drain_of_close_leaves_the_tear_down_to_close():
    # abort() is documented as safe from a signal handler or another thread while close() runs. Before,
    # an abort() that came while close() waited for the GPU (its drain) tore everything down at once
    # (streams, events, mappings) under the drain, which then went on polling the destroyed events.
    log = []
    transport = _transport(log)

    def abort_now():
        log.append("abort")
        transport.abort()
        log.append("abort returned")

    transport._watchdog.during_next_wait = abort_now
    transport.close()
    assert log.index("unmap peer") > log.index("abort returned")
    assert log.index("destroy stream") > log.index("abort returned")
    # The abort still counts: no barrier, the shared buffer is kept, and the error is the abort's.
    assert "barrier" not in log and "free buffer" not in log
    assert transport.leaked_nbytes == BUFFER_NBYTES and transport._finalizer.detached
    with pytest.raises(TransportFailedError, match="aborted"):
        transport._check_usable()


def test_abort_during_a_call_that_holds_the_watchdog_lock_returns_at_once():
    """A signal handler's abort() on the thread of a call interrupted inside ``with watchdog._lock``: the
    watchdog thread then waits on that lock, so abort() must not join it (it did, and never returned)."""
    from syncless.pp._watchdog import Watchdog

    log = []
    transport = _transport(log)
    dog = Watchdog(1.0, lambda what, waited: None, lambda event: None, lambda: None)
    transport._watchdog = dog
    transport._in_call = True  # the interrupted send() or recv()
    dog._lock.acquire()  # ... was inside watch() when the signal came
    try:
        time.sleep(0.05)  # the watchdog thread now waits on the lock in its poll
        done = threading.Event()
        aborter = threading.Thread(target=lambda: (transport.abort(), done.set()), daemon=True)
        aborter.start()
        assert done.wait(3.0), "abort() hung joining the watchdog"
    finally:
        dog._lock.release()
    dog.stop()
    assert not dog.thread.is_alive()
    assert isinstance(transport.error, TransportFailedError)

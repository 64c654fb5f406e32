"""The D2H queue and the offload's counts when a ``KeyboardInterrupt`` lands outside a job's own run (CPU).

Python runs a pending signal handler as a call returns, so a Ctrl-C pending from a copy can come out of the first
call after the job returned, out of the writing of its failure, or out of the ``Thread.start()`` of a queue's first
job. Each test injects one there, once, and checks that the queue is whole afterwards: the job on record as ended
(its failure kept) or queued, the runner reset, the lock free, the pending count in step, and every wait bounded.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from syncless.cc import _d2h
from syncless.cc._worker import D2HCopyError, OrderedWorker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def worker():
    queue = OrderedWorker("test-interrupts")
    yield queue
    queue.shutdown(5)


class _Job:
    """A job that counts its runs and its ``settled`` calls; ``interrupt_at`` makes the read of ``settled`` (the
    first call after the job returns) or the call of it raise KeyboardInterrupt, once."""

    def __init__(self, interrupt_at: str = ""):
        self.runs = self.settles = 0
        self.interrupt_at = interrupt_at

    def __call__(self) -> None:
        self.runs += 1

    @property
    def settled(self):
        if self.interrupt_at == "read":
            self.interrupt_at = ""
            raise KeyboardInterrupt
        return self._settle

    def _settle(self) -> None:
        if self.interrupt_at == "call":
            self.interrupt_at = ""
            raise KeyboardInterrupt  # (raised at its start: nothing of it ran)
        self.settles += 1


def _lock_is_free(queue) -> bool:
    """Whether another thread can take the queue's lock now (at once)."""
    taken = []

    def take():
        if queue._lock.acquire(timeout=2):
            taken.append(True)
            queue._lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join(5)
    return taken == [True]


def _waits_on_another_thread(queue, seq) -> bool:
    done = threading.Event()
    thread = threading.Thread(target=lambda: (queue.wait_for(seq), done.set()), daemon=True)
    thread.start()
    thread.join(10)
    return done.is_set()


@pytest.mark.parametrize("where", ["read", "call"])
def test_an_interrupt_after_the_job_returned_leaves_it_on_record_as_ended(worker, where):
    job = _Job(interrupt_at=where)
    seq = worker.submit(job, eager=False)
    with pytest.raises(KeyboardInterrupt):
        worker.wait_for(seq)  # this thread runs the job (a covering wait)
    assert job.runs == 1 and worker._completed == seq and not worker._jobs
    assert not worker._running and worker._runner is None
    assert job.settles <= 1  # never lowered twice (an interrupt at its start leaves the count high: only slower)
    assert _lock_is_free(worker)
    assert _waits_on_another_thread(worker, seq)
    later = _Job()
    then = worker.submit(later, eager=False)
    worker.wait_for(then)  # this thread's later waits wait (they returned at once, its copies unmade)
    assert later.runs == 1 and later.settles == 1


def test_an_interrupt_as_the_failure_is_written_keeps_the_failure(worker, monkeypatch):
    def fail():
        raise RuntimeError("the copy failed")

    seq = worker.submit(fail, "a copy", eager=False)

    def interrupted(job, err):
        raise KeyboardInterrupt

    monkeypatch.setattr(worker, "_failure_of", interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.wait_for(seq)
    monkeypatch.undo()
    assert worker._completed == seq and not worker._jobs  # ended, not put back (run again it would pass)
    with pytest.raises(D2HCopyError, match="the copy failed"):
        worker.wait_and_raise(seq)
    assert _lock_is_free(worker)


def test_an_interrupt_before_the_job_ran_puts_it_back(worker, monkeypatch):
    job = _Job()
    seq = worker.submit(job, eager=False)
    real_run = worker._jobs[0].run
    worker._jobs[0].run = lambda: (_ for _ in ()).throw(KeyboardInterrupt())  # the waiter's Ctrl-C in the job
    with pytest.raises(KeyboardInterrupt):
        worker.wait_for(seq)
    assert worker._jobs and worker._jobs[0].seq == seq and worker._completed == seq - 1
    worker._jobs[0].run = real_run
    worker.wait_for(seq)
    assert job.runs == 1 and job.settles == 1  # run once, after it was put back


def test_an_interrupt_in_the_first_submit_s_thread_start_keeps_the_pending_count_in_step(monkeypatch):
    record = _d2h._D2HStream(SimpleNamespace(name="D"))
    pending_before = _d2h._PENDING[0]
    real_start = threading.Thread.start

    def start_interrupted(thread):
        real_start(thread)
        raise KeyboardInterrupt  # delivered while start() waited for the new thread

    class Job:
        settled = staticmethod(_d2h._settled)

        def __call__(self):
            pass

    monkeypatch.setattr(threading.Thread, "start", start_interrupted)
    try:
        with _d2h._offload_lock, pytest.raises(KeyboardInterrupt):
            _d2h._submit_locked(record, Job(), False)
        monkeypatch.undo()
        assert record.worker._submitted == 1 and record.last_job == 1  # queued, and covered
        assert _d2h._PENDING[0] == pending_before + 1  # and counted
        record.worker.wait_for(1, timeout_s=10)
        assert _d2h._PENDING[0] == pending_before  # its run lowered it once: in step
    finally:
        monkeypatch.undo()
        record.worker.shutdown(5)
        with _d2h._offload_lock:
            _d2h._last_jobs.pop(record.worker, None)
            _d2h._rebuild_cover()

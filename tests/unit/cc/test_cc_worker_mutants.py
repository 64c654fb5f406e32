"""The ordered worker's edges: the fast path next to a failure, shutdown draining, waking waiters."""

import threading
import time

import pytest

from syncless.cc._worker import D2HCopyError, OrderedWorker


@pytest.fixture
def worker():
    w = OrderedWorker("test-worker-edges")
    yield w
    w.shutdown(5.0)


def _fail():
    raise OSError("copy-7 failed")


def test_a_wait_that_covers_exactly_the_failed_job_raises_it(worker):
    for _ in range(3):
        worker.wait_and_raise(worker.submit(lambda: None))
    seq = worker.submit(_fail, "copy B")
    worker.wait_for(seq)  # finished: only the failure is left to raise
    with pytest.raises(D2HCopyError, match=rf"copy B \(#{seq}\)"):
        worker.wait_and_raise(seq)
    worker.wait_and_raise(seq)  # reported once


def test_shutdown_finishes_the_jobs_queued_before_it(worker):
    ran = []
    gate = threading.Event()
    worker.submit(lambda: gate.wait(10))
    for i in range(5):
        worker.submit(lambda i=i: ran.append(i))
    assert worker.shutdown(0.05) is False  # the first job is still blocked
    gate.set()
    assert worker.shutdown(5.0) is True
    assert ran == list(range(5))
    assert worker.completed == 6


def test_shutdown_from_a_job_on_the_worker_thread_returns_at_once(worker):
    result = []
    seq = worker.submit(lambda: result.append(worker.shutdown(5.0)))
    worker.wait_and_raise(seq)  # raises if the job failed
    assert result == [True]


def test_a_waiter_wakes_when_its_job_finishes_not_at_its_next_poll(worker):
    gate = threading.Event()
    seq = worker.submit(lambda: gate.wait(10))
    woke = []

    def waiter():
        worker.wait_for(seq, poll_s=60.0)
        woke.append(time.monotonic())

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.2)  # let the waiter block first (only makes the check sharper; never a false failure)
    released = time.monotonic()
    gate.set()
    thread.join(20.0)
    assert woke and woke[0] - released < 15.0

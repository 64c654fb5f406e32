"""The ordered worker's edges: shutdown from its own thread, and waking a waiter at once."""

import threading
import time

import pytest

from syncless.cc._worker import OrderedWorker


@pytest.fixture
def worker():
    w = OrderedWorker("test-worker-edges")
    yield w
    w.shutdown(5.0)


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

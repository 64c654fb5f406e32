"""The ordered worker thread: order, waits, error surfacing, shutdown (also from its own thread)."""

import threading
import time

import pytest

from syncless.cc._worker import D2HCopyError, OrderedWorker


@pytest.fixture
def worker():
    w = OrderedWorker("test-worker")
    yield w
    w.shutdown(5.0)


def test_runs_in_order_and_wait_for(worker):
    seen = []
    gate = threading.Event()
    worker.submit(lambda: (gate.wait(5), seen.append(0)))
    for i in range(1, 50):
        worker.submit(lambda i=i: seen.append(i))
    assert worker.submitted == 50
    assert worker.is_pending(1)
    gate.set()
    worker.wait_for(50)
    assert seen == list(range(50))
    assert worker.completed == 50
    assert not worker.is_pending(50)


def test_submit_returns_before_job_runs(worker):
    gate = threading.Event()
    done = threading.Event()
    seq = worker.submit(lambda: (gate.wait(5), done.set()))
    assert seq == 1 and not done.is_set() and worker.is_pending(seq)
    gate.set()
    worker.wait_for(seq)
    assert done.is_set()


def _fail():
    raise KeyError("boom-42")


def test_error_surfaces_only_at_covering_wait(worker):
    worker.submit(lambda: None)              # 1
    worker.submit(_fail, "copy A")           # 2
    gate = threading.Event()
    worker.submit(lambda: gate.wait(5))      # 3
    worker.wait_and_raise(1)                 # does not cover #2
    gate.set()
    with pytest.raises(D2HCopyError) as info:
        worker.wait_and_raise(3)
    err = info.value
    assert "copy A (#2)" in str(err) and "boom-42" in str(err)
    assert "_fail" in err.worker_traceback and "KeyError" in err.worker_traceback
    assert isinstance(err.__cause__, KeyError)
    # Reported once, and the worker keeps going.
    worker.wait_and_raise(3)
    seq = worker.submit(lambda: None)
    worker.wait_and_raise(seq)


def test_several_failures_counted_in_one_report(worker):
    worker.submit(_fail, "first")
    worker.submit(_fail, "second")
    with pytest.raises(D2HCopyError, match=r"first \(#1\).*1 more failed"):
        worker.wait_and_raise(2)
    assert worker.failures_pending() == 0


def test_later_failure_stays_for_a_later_wait(worker):
    gate = threading.Event()
    worker.submit(lambda: gate.wait(5))
    worker.submit(_fail, "late")
    gate.set()
    worker.wait_for(2)
    worker.raise_errors(1)  # #2 not covered
    assert worker.failures_pending() == 1
    with pytest.raises(D2HCopyError, match="late"):
        worker.raise_errors(2)


def test_shutdown_is_bounded_and_refuses_new_jobs():
    w = OrderedWorker("test-shutdown")
    gate = threading.Event()
    w.submit(lambda: gate.wait(5))
    assert w.shutdown(0.05) is False  # job still blocked: returns anyway
    gate.set()
    assert w.shutdown(5.0) is True
    with pytest.raises(RuntimeError, match="shut down"):
        w.submit(lambda: None)
    w.restart()
    w.wait_for(w.submit(lambda: None))
    w.shutdown(5.0)


def test_wait_from_worker_thread_does_not_deadlock(worker):
    result = []

    def job():
        worker.wait_for(worker.submitted + 5)  # would wait for itself
        result.append("ok")

    worker.wait_for(worker.submit(job))
    assert result == ["ok"]


def test_wait_and_raise_zero_is_noop(worker):
    worker.wait_and_raise(0)


def test_bounded_wait_for_a_stuck_copy_raises_in_time(worker):
    import time

    from syncless.cc._worker import D2HTimeoutError

    gate = threading.Event()
    seq = worker.submit(lambda: gate.wait(30))  # a copy whose producer never finishes
    start = time.monotonic()
    with pytest.raises(D2HTimeoutError, match=r"unfinished after 0.3 s"):
        worker.wait_and_raise(seq, timeout_s=0.3)
    assert time.monotonic() - start < 5
    gate.set()
    worker.wait_for(seq)


def _hold_the_lock(worker):
    """Have another thread hold the worker's lock; return (an event set once it holds it, a function releasing it)."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with worker._cv:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(5)

    def let_go():
        release.set()
        holder.join(5)

    return held, let_go


def _wait_while_lock_is_held(worker, seq):
    """Call wait_and_raise(seq) while another thread holds the worker's lock.

    Returns (whether it returned while the lock was held, what it raised once it could finish).
    """
    held, release = _hold_the_lock(worker)
    finished = threading.Event()
    raised = []

    def call():
        try:
            worker.wait_and_raise(seq)
        except Exception as err:  # noqa: BLE001 - handed to the test
            raised.append(err)
        finished.set()

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    early = finished.wait(0.5)
    release()
    caller.join(5)
    return early, (raised[0] if raised else None)


def test_settled_wait_does_not_take_the_lock(worker):
    seq = worker.submit(lambda: None)
    worker.wait_for(seq)
    assert _wait_while_lock_is_held(worker, seq) == (True, None)


def test_unraised_failure_still_takes_the_slow_path(worker):
    # issued by a thread that has ended, so the waiting thread below raises it
    threading_submit = threading.Thread(target=lambda: worker.submit(_fail, "kept"))  # 1
    threading_submit.start()
    threading_submit.join(10)
    ok = worker.submit(lambda: None)             # 2
    worker.wait_for(ok)
    early, raised = _wait_while_lock_is_held(worker, ok)
    assert not early  # #1's failure waits to be raised: no shortcut
    assert isinstance(raised, D2HCopyError) and "kept" in str(raised)
    # Every thread has it once (issue 33 item 2): this one too, and then its waits take the fast path again.
    with pytest.raises(D2HCopyError, match="kept"):
        worker.wait_and_raise(ok)
    _, release = _hold_the_lock(worker)
    try:
        worker.wait_and_raise(ok)  # would block on the held lock if it took the slow path
    finally:
        release()


def test_failure_after_the_waited_range_does_not_block_the_fast_path(worker):
    first = worker.submit(lambda: None)          # 1
    worker.submit(_fail, "later")                # 2
    worker.wait_for(2)
    assert _wait_while_lock_is_held(worker, first) == (True, None)
    with pytest.raises(D2HCopyError, match="later"):
        worker.wait_and_raise(2)


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


def _in_thread(fn):
    """Run ``fn`` on a new host thread; return what it returned or raised."""
    out = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            out.append(("raised", err))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    return out[0]


def test_a_failure_reaches_every_covering_thread_once_and_the_issuing_thread_too(worker):
    """Issue 27 item 4: an unrelated thread's torch.cuda.synchronize() (which covers every job) used to get thread
    A's error and forget it, so A's own ``ready.synchronize()`` returned normally. Review: a consumer thread whose
    synchronize covers it must not see all clear either (it would read the unwritten buffer)."""
    issued = threading.Event()
    finish = threading.Event()
    seqs = []

    def thread_a():
        seqs.append(worker.submit(_fail, "A's copy"))
        issued.set()
        finish.wait(10)
        worker.wait_and_raise(seqs[0])  # A's own covering call

    a = threading.Thread(target=lambda: seqs.append(_in_thread_result(thread_a)))
    a.start()
    assert issued.wait(10)
    worker.wait_for(seqs[0])
    with pytest.raises(D2HCopyError, match="A's copy"):
        worker.wait_and_raise(worker.submitted)  # another thread's covering call: it gets the error too
    worker.wait_and_raise(worker.submitted)  # once per thread
    assert worker.failures_pending() == 1  # kept for A, which issued it
    finish.set()
    a.join(10)
    kind, err = seqs[1]
    assert kind == "raised" and isinstance(err, D2HCopyError) and "A's copy" in str(err)
    assert worker.failures_pending() == 0


def _in_thread_result(fn):
    try:
        return ("ok", fn())
    except BaseException as err:  # noqa: BLE001 - handed back to the test
        return ("raised", err)


def test_a_failure_of_a_thread_that_has_ended_is_raised_by_any_covering_call(worker):
    seq = _in_thread(lambda: worker.submit(_fail, "orphan"))[1]
    worker.wait_for(seq)
    with pytest.raises(D2HCopyError, match="orphan"):
        worker.wait_and_raise(seq)


def test_uninstall_raises_every_threads_failure(worker):
    """``drain`` (what ``uninstall()`` calls) raises whatever is left, whichever thread issued it."""
    hold = threading.Event()
    done = threading.Event()

    def issue_and_stay():
        worker.submit(_fail, "kept")
        done.set()
        hold.wait(10)

    thread = threading.Thread(target=issue_and_stay)
    thread.start()
    try:
        assert done.wait(10)
        worker.wait_for(1)
        with pytest.raises(D2HCopyError, match="kept"):
            worker.wait_and_raise(1)  # not this thread's, but it covers it: raised here once, kept for its thread
        worker.wait_and_raise(1)
        assert worker.failures_pending() == 1
        with pytest.raises(D2HCopyError, match="kept"):
            worker.wait_and_raise(1, any_thread=True)
        assert worker.failures_pending() == 0
    finally:
        hold.set()
        thread.join(10)


def test_a_failed_jobs_error_lets_go_of_what_its_frames_held(worker):
    """Issue 27 item 4: until it was raised, the error's traceback kept the snapshot and the pinned destination
    alive (the frames of the wrappers the copy went through hold them)."""
    import gc
    import weakref

    class Big:
        pass

    refs = []

    def job():
        big = Big()
        refs.append(weakref.ref(big))
        raise RuntimeError("out of memory (stand-in)")

    seq = worker.submit(job, "copy")
    worker.wait_for(seq)
    gc.collect()
    assert refs[0]() is None, "the failed job's locals are still alive"
    with pytest.raises(D2HCopyError, match="out of memory"):
        worker.wait_and_raise(seq)


def test_a_failed_copy_stays_pending_until_its_failure_is_on_record(monkeypatch):
    """Review: the count of unfinished copies fell as the job raised, before the worker recorded the failure; an
    event recorded in between covered nothing and its synchronize reported all clear."""
    import traceback as traceback_module

    from syncless.cc import _d2h, _worker

    formatting = threading.Event()
    release = threading.Event()
    real_format = traceback_module.format_exception

    def slow_format(*args, **kwargs):  # holds the worker between the job's end and its record of the failure
        formatting.set()
        release.wait(5)
        return real_format(*args, **kwargs)

    monkeypatch.setattr(_worker.traceback, "format_exception", slow_format)
    worker = _worker.OrderedWorker("test-d2h")
    before = _d2h._PENDING[0]

    def failing_copy():
        raise RuntimeError("CUDA error: an illegal memory access (stand-in)")

    with _d2h._pending_lock:
        _d2h._PENDING[0] += 1
    failing_copy.settled = _d2h._settled
    seq = worker.submit(failing_copy, "copy_(non_blocking=True)")
    try:
        assert formatting.wait(5)
        time.sleep(0.05)
        assert _d2h._PENDING[0] == before + 1, "counted as finished before its failure was recorded"
    finally:
        release.set()
    worker.wait_for(seq, timeout_s=5)
    assert _d2h._PENDING[0] == before  # lowered in the same locked step that records the job as finished
    with pytest.raises(Exception, match="illegal memory access"):
        worker.raise_errors(seq, any_thread=True)
    worker.shutdown(5)


def test_a_consumer_gets_a_failure_its_issuing_thread_had_first(worker):
    """Issue 33 item 2: once the issuing thread had raised its failure, the failure was forgotten, and a consumer
    thread synchronizing an event handed to it read the unwritten buffer with no error."""
    seq = worker.submit(_fail, "handed over")
    with pytest.raises(D2HCopyError, match="handed over"):
        worker.wait_and_raise(seq)  # the issuing thread synchronizes first
    kind, err = _in_thread(lambda: worker.wait_and_raise(seq))  # then the consumer
    assert kind == "raised" and isinstance(err, D2HCopyError) and "handed over" in str(err)
    worker.wait_and_raise(seq)  # once per thread
    assert worker.failures_pending() == 0  # uninstall() would raise nothing: its issuer had it


def test_a_failure_issued_by_a_thread_threading_did_not_make_is_raised_once_per_thread(worker):
    """Issue 33 item 2: a thread ``threading`` did not create is always "alive", so its failures were never
    forgotten and every wait of every thread took the slow path from then on."""
    import _thread

    done = threading.Event()
    seqs = []

    def foreign():
        seqs.append(worker.submit(_fail, "foreign"))
        done.set()

    _thread.start_new_thread(foreign, ())
    assert done.wait(10)
    with pytest.raises(D2HCopyError, match="foreign"):
        worker.wait_and_raise(seqs[0])
    later = worker.submit(lambda: None)
    worker.wait_for(later)
    assert later <= worker.completed and worker.newest_failure <= worker._seen_upto()  # the fast path's test
    worker.wait_and_raise(later)


def test_a_thread_that_waits_runs_the_job_itself_and_the_queue_thread_stays_asleep():
    """Issue 33: a covering wait runs the queued job on the waiting thread (no wake of the queue's thread, no
    hand-off of the GIL); a job nobody waits for is run by the queue's thread once its grace has passed."""
    from syncless.cc import _worker

    worker = OrderedWorker("test-helping")
    try:
        ran_on = []
        seq = worker.submit(lambda: ran_on.append(threading.current_thread()), eager=False)
        worker.wait_for(seq)
        assert ran_on == [threading.current_thread()]
        done = threading.Event()
        worker.submit(lambda: (ran_on.append(threading.current_thread()), done.set()), eager=False)
        assert done.wait(10 + 50 * _worker.GRACE_S)  # nobody waits: the queue's own thread takes it
        assert ran_on[-1] is worker._thread
        eager = threading.Event()
        worker.submit(lambda: (ran_on.append(threading.current_thread()), eager.set()), eager=True)
        assert eager.wait(10)
        assert ran_on[-1] is worker._thread
    finally:
        worker.shutdown(5)


def test_an_interrupt_while_a_waiter_runs_the_job_puts_it_back_for_the_queue():
    """A Ctrl-C reaching a thread that runs the job it waited for is raised on, and the job is not lost: the queue's
    own thread runs it again from its start."""
    worker = OrderedWorker("test-interrupt")
    try:
        runs = []

        def job():
            runs.append(threading.current_thread())
            if len(runs) == 1:
                raise KeyboardInterrupt

        seq = worker.submit(job, eager=False)
        with pytest.raises(KeyboardInterrupt):
            worker.wait_for(seq)
        worker.wait_for(seq, timeout_s=10)  # a bounded wait: the queue's thread runs it
        assert len(runs) == 2 and runs[1] is worker._thread
        worker.raise_errors(seq)  # not a failure
    finally:
        worker.shutdown(5)


def test_jobs_run_by_their_waiter_do_not_wake_the_queue_thread(monkeypatch):
    """Issue 33: a job's end woke the queue's thread (one condition for it and the waiters), which then took the GIL
    while the decode loop ran Python, twice per job on the H200. Now 200 jobs, each waited for half a millisecond after
    its submit,
    wake it only for its grace deadlines (a few times in all), not once per job."""
    wakes = []
    original_wait = threading.Condition.wait

    def counting_wait(self, timeout=None):
        result = original_wait(self, timeout)
        if threading.current_thread().name == "test-wakes":
            wakes.append(timeout)
        return result

    monkeypatch.setattr(threading.Condition, "wait", counting_wait)
    worker = OrderedWorker("test-wakes")
    try:
        ran_on = set()
        started = time.monotonic()
        for _ in range(200):
            seq = worker.submit(lambda: ran_on.add(threading.current_thread()), eager=False)
            time.sleep(0.0005)  # the rest of the step (the queue's thread may be scheduled meanwhile)
            worker.wait_for(seq)
        elapsed = time.monotonic() - started
        assert ran_on == {threading.current_thread()}
        from syncless.cc import _worker

        # One wake per grace period that passed (its deadline), and a couple more to go idle; never one per job.
        assert len(wakes) <= 3 + 2 * elapsed / _worker.GRACE_S, (len(wakes), elapsed)
        assert len(wakes) < 50
    finally:
        worker.shutdown(5)

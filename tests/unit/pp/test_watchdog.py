"""The pp watchdog with stand-in events (CPU only).

When it fires, and that it fires again for a later stuck wait; when the
clock runs for a relayed send; and its bookkeeping: streams, pending counts,
recycling, idling.
"""

from __future__ import annotations

import threading
import time

from syncless.pp._watchdog import Bracket, Watchdog


class FakeEvent:
    """An event whose completion the test sets by hand."""

    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


def _watchdog(timeout_s, fired):
    lock = threading.Lock()

    def on_timeout(what, waited_s):
        with lock:
            fired.append((what, waited_s))

    return Watchdog(timeout_s, on_timeout, recycle=lambda event: None, bind_context=lambda: None)


def _watching(fired, *brackets):
    dog = _watchdog(0.1, fired)
    for bracket in brackets:
        dog.watch(bracket)
    return dog


def _finish(dog, *brackets):
    """Let ``brackets`` complete, then the watchdog must go idle and stop."""
    for bracket in brackets:
        bracket.pre.done = bracket.post.done = True
    dog.wait_idle()
    dog.stop()


def _wait_until(condition, limit_s=5.0):
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def test_a_wait_past_its_timeout_fires_once_and_a_finished_one_never():
    fired = []
    stuck = Bracket(1, FakeEvent(True), FakeEvent(False), "step {}", 2)
    dog = _watching(fired, Bracket(1, FakeEvent(True), FakeEvent(True), "step {}", 1), stuck)
    _wait_until(lambda: fired)
    time.sleep(0.3)  # several more polls past the timeout: still one call for this bracket
    assert [what for what, _ in fired] == ["step 2"] and fired[0][1] > 0.1
    _finish(dog, stuck)


def test_a_later_wait_that_blocks_again_is_released_in_its_turn():
    # A late peer overwrote the release value: the next step's wait blocks again and must fire too,
    # or close() (wait_idle) would never return.
    fired = []
    first = Bracket(7, FakeEvent(True), FakeEvent(False), "step {}", 5)
    second = Bracket(7, FakeEvent(False), FakeEvent(False), "step {}", 6)
    dog = _watching(fired, first, second)
    _wait_until(lambda: len(fired) == 1)
    first.post.done = True  # the release let step 5 through ...
    second.pre.done = True  # ... and step 6 reached its wait, which blocks again
    _wait_until(lambda: len(fired) == 2)
    assert [what for what, _ in fired] == ["step 5", "step 6"]
    _finish(dog, second)


def test_time_before_the_wait_is_reached_does_not_count():
    fired = []
    busy = Bracket(3, FakeEvent(False), FakeEvent(False), "step {}", 1)  # a long kernel ahead of the wait
    dog = _watching(fired, busy)
    time.sleep(0.3)
    assert fired == []
    _finish(dog, busy)


def _relayed(stream, step, *, caller_done, wait_over):
    """A relayed send's bracket: pre, flag wait, `waited`, then the caller's work (`ready`), copies, post."""
    return Bracket(stream, FakeEvent(True), FakeEvent(False), "step {}", step,
                   waited=FakeEvent(wait_over), ready=FakeEvent(caller_done))


def test_time_after_the_wait_is_over_does_not_count_but_a_stuck_wait_does():
    fired = []
    caller_busy = _relayed(4, 1, caller_done=False, wait_over=True)  # the caller's long kernel, after the wait
    peer_stuck = _relayed(5, 2, caller_done=True, wait_over=False)
    dog = _watching(fired, caller_busy, peer_stuck)
    _wait_until(lambda: fired)
    time.sleep(0.3)
    assert [what for what, _ in fired] == ["step 2"]
    assert dog.pending() == 2  # the caller's bracket stays listed until its post, so close() waits for it
    for bracket in (caller_busy, peer_stuck):
        bracket.waited.done = bracket.ready.done = True
    _finish(dog, caller_busy, peer_stuck)


def test_a_slow_receiver_counts_only_from_when_the_callers_work_is_done():
    # The relay reached the flag wait long before the caller's work for the step was done: the receiver
    # being slower than the caller is not its delay. Once the caller's work is done, the clock runs.
    fired = []
    slow = _relayed(6, 3, caller_done=False, wait_over=False)
    dog = _watching(fired, slow)
    time.sleep(0.35)  # more than three timeouts with only `pre` done
    assert fired == []
    slow.ready.done = True
    started = time.monotonic()
    _wait_until(lambda: fired)
    assert time.monotonic() - started >= 0.1 and [what for what, _ in fired] == ["step 3"]
    slow.waited.done = True
    _finish(dog, slow)


def test_every_event_of_a_finished_bracket_is_handed_back_once():
    handed_back = []
    dog = Watchdog(5.0, lambda what, waited_s: None, recycle=handed_back.append, bind_context=lambda: None)
    events = [FakeEvent(True) for _ in range(6)]
    dog.watch(Bracket(1, events[0], events[1], "step {}", 1, waited=events[2], ready=events[3]))
    dog.watch(Bracket(2, events[4], events[5], "step {}", 1))
    dog.wait_idle()
    dog.stop()
    assert sorted(map(id, handed_back)) == sorted(map(id, events))


def test_stop_leaves_an_unfinished_bracket_listed_for_wait_idle():
    # close() and abort() stop the thread, then wait (bounded) for what is still on the GPU: a
    # bracket dropped by stop() would make an unfinished GPU look idle, and memory be freed under it.
    handed_back = []
    dog = Watchdog(5.0, lambda what, waited_s: None, recycle=handed_back.append, bind_context=lambda: None)
    bracket = _relayed(3, 1, caller_done=False, wait_over=False)
    dog.watch(bracket)
    dog.stop()
    assert handed_back == [] and dog.pending() == 1
    assert dog.wait_idle(deadline_s=0.05) is False
    bracket.post.done = True
    assert dog.wait_idle(deadline_s=5.0) is True
    assert sorted(map(id, handed_back)) == sorted(map(id, (bracket.pre, bracket.ready, bracket.waited, bracket.post)))


def test_a_release_that_raises_is_tried_again_and_never_kills_the_thread():
    # Before: the bracket was marked released before on_timeout ran; when that raised, the thread died
    # and the wait was never released, so close() (wait_idle) looped for ever.
    calls = []

    def on_timeout(what, waited_s):
        calls.append(what)
        if len(calls) == 1:
            raise RuntimeError("[fake driver] the release write failed")

    dog = Watchdog(0.05, on_timeout, recycle=lambda event: None, bind_context=lambda: None)
    stuck = Bracket(1, FakeEvent(True), FakeEvent(False), "step {}", 3)
    dog.watch(stuck)
    _wait_until(lambda: len(calls) >= 2)
    assert dog.thread.is_alive()
    time.sleep(0.2)
    assert calls == ["step 3", "step 3"]  # released once it worked, then never again
    stuck.post.done = True
    assert dog.wait_idle(deadline_s=5.0) is True
    dog.stop()


def test_wait_idle_gives_up_at_its_deadline():
    dog = Watchdog(60.0, lambda what, waited_s: None, recycle=lambda event: None, bind_context=lambda: None)
    dog.watch(Bracket(1, FakeEvent(True), FakeEvent(False), "step {}", 1))
    start = time.monotonic()
    assert dog.wait_idle(deadline_s=0.1) is False
    assert time.monotonic() - start < 2.0
    dog.stop()


def test_the_thread_holds_its_transport_weakly_and_ends_when_it_is_gone():
    import gc
    import weakref

    class Owner:
        def __init__(self):
            self.fired = []

        def on_timeout(self, what, waited_s):
            self.fired.append(what)

    owner = Owner()
    dog = Watchdog(0.05, weakref.WeakMethod(owner.on_timeout), recycle=lambda event: None, bind_context=lambda: None)
    dog.watch(Bracket(1, FakeEvent(True), FakeEvent(False), "step {}", 1))
    _wait_until(lambda: owner.fired)
    gone = weakref.ref(owner)
    dog.watch(Bracket(2, FakeEvent(True), FakeEvent(False), "step {}", 2))
    del owner
    gc.collect()
    assert gone() is None  # the thread kept no strong reference
    _wait_until(lambda: not dog.thread.is_alive())


# -- bookkeeping ------------------------------------------------------------------


class Recorder:
    """Collects what the watchdog reports and hands back, from its thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.fired = []
        self.recycled = []

    def on_timeout(self, what, waited_s):
        with self.lock:
            self.fired.append(what)

    def recycle(self, event):
        with self.lock:
            self.recycled.append(event)


def _recording_watchdog(record, timeout_s=0.1, bind_context=lambda: None):
    return Watchdog(timeout_s, record.on_timeout, record.recycle, bind_context)


def _bracket(stream, step, reached=False, finished=False):
    return Bracket(stream, FakeEvent(reached or finished), FakeEvent(finished), "step {}", step)


def _complete(*brackets):
    """Let ``brackets`` complete (the test decides when the watchdog goes idle and stops)."""
    for bracket in brackets:
        bracket.pre.done = bracket.post.done = True


def _in_thread(fn):
    """Run ``fn`` on a daemon thread; return an event set when it returns."""
    returned = threading.Event()

    def run():
        fn()
        returned.set()

    threading.Thread(target=run, daemon=True).start()
    return returned


def test_each_stream_is_watched_on_its_own():
    record = Recorder()
    dog = _recording_watchdog(record)
    stuck = [_bracket(stream, step, reached=True) for stream, step in ((11, 1), (12, 2), (13, 3))]
    for bracket in stuck:
        dog.watch(bracket)
    _wait_until(lambda: len(record.fired) == 3)
    assert sorted(record.fired) == ["step 1", "step 2", "step 3"]
    _complete(*stuck)
    dog.wait_idle()
    dog.stop()


def test_pending_counts_every_unfinished_bracket():
    record = Recorder()
    dog = _recording_watchdog(record, timeout_s=60.0)
    waiting = [_bracket(1, 1), _bracket(1, 2), _bracket(2, 3)]
    for bracket in waiting:
        dog.watch(bracket)
    assert dog.pending() == 3
    _complete(waiting[0])
    _wait_until(lambda: dog.pending() == 2)
    _complete(*waiting[1:])
    dog.wait_idle()
    assert dog.pending() == 0
    dog.stop()


def test_wait_idle_returns_only_once_the_last_bracket_finished():
    record = Recorder()
    dog = _recording_watchdog(record, timeout_s=60.0)
    last = _bracket(4, 1)
    dog.watch(last)
    returned = _in_thread(dog.wait_idle)
    assert not returned.wait(0.3)  # one bracket is still unfinished
    _complete(last)
    assert returned.wait(5.0)
    dog.stop()


def test_every_finished_brackets_events_are_recycled_exactly_once():
    record = Recorder()
    dog = _recording_watchdog(record, timeout_s=60.0)
    brackets = [_bracket(stream, step) for stream, step in ((1, 1), (1, 2), (2, 3))]
    for bracket in brackets:
        dog.watch(bracket)
    _complete(*brackets)
    dog.wait_idle()
    dog.stop()
    expected = [event for bracket in brackets for event in (bracket.pre, bracket.post)]
    assert sorted(map(id, record.recycled)) == sorted(map(id, expected))


def test_wait_idle_polls_by_itself_when_the_thread_died():
    record = Recorder()

    def no_context():
        raise RuntimeError("[fake driver] cannot make the context current")

    dog = _recording_watchdog(record, bind_context=no_context)  # the thread logs and ends at once
    done = _bracket(6, 1, finished=True)
    dog.watch(done)
    returned = _in_thread(dog.wait_idle)
    assert returned.wait(5.0), "wait_idle kept waiting for a watchdog thread that is gone"
    assert sorted(map(id, record.recycled)) == sorted([id(done.pre), id(done.post)])
    dog.stop()

"""The pp watchdog's bookkeeping with stand-in events (CPU only): streams, pending counts, recycling, idling."""

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


def _watchdog(record, timeout_s=0.1, bind_context=lambda: None):
    return Watchdog(timeout_s, record.on_timeout, record.recycle, bind_context)


def _bracket(stream, step, reached=False, finished=False):
    return Bracket(stream, FakeEvent(reached or finished), FakeEvent(finished), "step {}", step)


def _wait_until(condition, limit_s=5.0):
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def _finish(*brackets):
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
    dog = _watchdog(record)
    stuck = [_bracket(stream, step, reached=True) for stream, step in ((11, 1), (12, 2), (13, 3))]
    for bracket in stuck:
        dog.watch(bracket)
    _wait_until(lambda: len(record.fired) == 3)
    assert sorted(record.fired) == ["step 1", "step 2", "step 3"]
    _finish(*stuck)
    dog.wait_idle()
    dog.stop()


def test_pending_counts_every_unfinished_bracket():
    record = Recorder()
    dog = _watchdog(record, timeout_s=60.0)
    waiting = [_bracket(1, 1), _bracket(1, 2), _bracket(2, 3)]
    for bracket in waiting:
        dog.watch(bracket)
    assert dog.pending() == 3
    _finish(waiting[0])
    _wait_until(lambda: dog.pending() == 2)
    _finish(*waiting[1:])
    dog.wait_idle()
    assert dog.pending() == 0
    dog.stop()


def test_wait_idle_returns_only_once_the_last_bracket_finished():
    record = Recorder()
    dog = _watchdog(record, timeout_s=60.0)
    last = _bracket(4, 1)
    dog.watch(last)
    returned = _in_thread(dog.wait_idle)
    assert not returned.wait(0.3)  # one bracket is still unfinished
    _finish(last)
    assert returned.wait(5.0)
    dog.stop()


def test_every_finished_brackets_events_are_recycled_exactly_once():
    record = Recorder()
    dog = _watchdog(record, timeout_s=60.0)
    brackets = [_bracket(stream, step) for stream, step in ((1, 1), (1, 2), (2, 3))]
    for bracket in brackets:
        dog.watch(bracket)
    _finish(*brackets)
    dog.wait_idle()
    dog.stop()
    expected = [event for bracket in brackets for event in (bracket.pre, bracket.post)]
    assert sorted(map(id, record.recycled)) == sorted(map(id, expected))


def test_stop_hands_back_the_events_of_brackets_still_listed():
    record = Recorder()
    dog = _watchdog(record, timeout_s=60.0)
    unfinished = _bracket(5, 1, reached=True)
    dog.watch(unfinished)
    dog.stop()
    assert sorted(map(id, record.recycled)) == sorted([id(unfinished.pre), id(unfinished.post)])
    assert dog.pending() == 0


def test_wait_idle_polls_by_itself_when_the_thread_died():
    record = Recorder()

    def no_context():
        raise RuntimeError("[fake driver] cannot make the context current")

    dog = _watchdog(record, bind_context=no_context)  # the thread logs and ends at once
    done = _bracket(6, 1, finished=True)
    dog.watch(done)
    returned = _in_thread(dog.wait_idle)
    assert returned.wait(5.0), "wait_idle kept waiting for a watchdog thread that is gone"
    assert sorted(map(id, record.recycled)) == sorted([id(done.pre), id(done.post)])
    dog.stop()

"""One ``checking()``/``allowed()`` object shared by threads, and regions closed out of order.

A module-level ``REGION = syncs.checking()`` entered by every worker of a
pool must give each thread back its own entry, whatever the interleaving; a
generator's region closed inside its consumer's own region (``close()``, or
the generator collected there) must leave the consumer's region checking.
"""

from __future__ import annotations

import gc
import sys
import threading

import pytest

from syncless import syncs
from syncless.syncs import _debugmode, _state

from .conftest import torch_sync_warning


def _pause_at_first_pop(reached: threading.Event, resume: threading.Event):
    """A trace function that stops this thread just before ``TokenStack.pop`` takes an entry off a list."""
    state_file = _state.__file__
    paused = []

    def local(frame, event, arg):
        if event == "line" and not paused:
            import linecache

            if ".pop(" in linecache.getline(state_file, frame.f_lineno):
                paused.append(True)
                reached.set()
                resume.wait(10)
        return local

    def tracer(frame, event, arg):
        if frame.f_code.co_filename == state_file and frame.f_code.co_name == "pop":
            return local
        return None

    return tracer


def test_a_thread_leaving_a_shared_region_takes_back_its_own_entry_whatever_the_interleaving(fake_mode):
    # Thread A is inside `region` and starts to leave it; it stops just before it takes an entry off the
    # shared bookkeeping. Thread B enters the same object meanwhile. A must still take back its own entry
    # (its region closes, disarmed), and B's region must stay open, checked, until B leaves.
    region = syncs.checking()
    a_inside, a_reached_pop, a_resume, b_inside, b_may_leave = (threading.Event() for _ in range(5))
    errors: list[BaseException] = []

    def thread_a():
        try:
            with region:
                a_inside.set()
                sys.settrace(_pause_at_first_pop(a_reached_pop, a_resume))
            sys.settrace(None)
        except BaseException as err:  # handed to the main thread
            errors.append(err)

    def thread_b():
        try:
            with region:
                b_inside.set()
                b_may_leave.wait(10)
                torch_sync_warning()  # B's own region: a violation, recorded
        except BaseException as err:
            errors.append(err)

    a = threading.Thread(target=thread_a)
    a.start()
    assert a_inside.wait(10) and a_reached_pop.wait(10)
    b = threading.Thread(target=thread_b)
    b.start()
    assert b_inside.wait(10)
    a_resume.set()
    a.join(10)
    assert _debugmode.armer.count == 1, "A's exit did not close exactly its own region"
    b_may_leave.set()
    b.join(10)
    assert not errors, errors
    assert _debugmode.armer.count == 0
    assert fake_mode.level == _debugmode.LEVEL_OFF
    assert syncs.report().total == 1, syncs.report().format()


@pytest.mark.parametrize("factory", [syncs.checking, syncs.allowed], ids=["checking", "allowed"])
def test_one_object_shared_by_eight_threads_under_stress(factory, fake_mode):
    shared = factory()
    rounds = 400
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker():
        try:
            start.wait(10)
            for _ in range(rounds):
                with syncs.checking():
                    with shared:
                        with shared:
                            pass
                    torch_sync_warning()  # every `shared` entry of this thread has closed: a violation
        except BaseException as err:  # handed to the main thread
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert _debugmode.armer.count == 0
    assert fake_mode.level == _debugmode.LEVEL_OFF
    assert syncs.report().total == 8 * rounds, syncs.report().format(stacks=False)
    torch_sync_warning()  # after every region: nothing counts
    assert syncs.report().total == 8 * rounds


@pytest.mark.parametrize("how", ["close", "collected"])
def test_a_generator_region_closed_inside_the_consumers_region_leaves_it_checking(how, fake_mode):
    def chunks():
        with syncs.checking():
            yield 1

    stream = chunks()
    next(stream)  # suspended inside its region, which the consumer's context now sees
    with syncs.checking():
        if how == "close":
            stream.close()
        else:
            del stream
            gc.collect()
        torch_sync_warning()  # the consumer's own region: a violation
    torch_sync_warning()  # after it: not checked
    assert syncs.report().total == 1, syncs.report().format()
    assert _debugmode.armer.count == 0


def test_an_allow_region_closed_out_of_order_leaves_the_later_one_allowing(fake_mode):
    def quiet():
        with syncs.allowed():
            yield 1

    with syncs.checking():
        stream = quiet()
        with syncs.allowed():
            next(stream)
            stream.close()  # the generator's allow region ends first
            torch_sync_warning()  # still inside this block's own allow region
        torch_sync_warning()  # no allow region left: a violation
    assert syncs.report().total == 1, syncs.report().format()

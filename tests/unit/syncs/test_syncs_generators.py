"""Regions across generators, streaming responses and reused context-manager objects.

A generator runs in its consumer's context, so what its ``with`` blocks set
is seen by the consumer while it is suspended; a streaming response resumes
it on whatever thread serves the next chunk.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

import pytest

from syncless import syncs
from syncless.syncs import _backend, _debugmode, _hook

from .conftest import torch_sync_warning


def test_a_generator_suspended_inside_allowed_does_not_allow_its_consumer(fake_mode):
    def chunks():
        with syncs.allowed():
            torch_sync_warning()  # allowed: the generator's own sync
            yield 1
        yield 2

    with syncs.checking():
        stream = chunks()
        next(stream)  # suspended inside `with allowed():`
        torch_sync_warning()  # the consumer's sync: a violation
        next(stream)
    assert syncs.report().total == 1, syncs.report().format()


def test_a_contextmanager_generator_that_yields_inside_allowed_still_allows_its_block(fake_mode):
    @contextlib.contextmanager
    def quiet():
        with syncs.allowed():
            yield

    with syncs.checking(), quiet():
        torch_sync_warning()
    with syncs.checking():
        torch_sync_warning()  # after the block: counts
    assert syncs.report().total == 1, syncs.report().format()


def test_checking_across_a_yield_resumed_on_a_pool_thread_leaves_nothing_behind(fake_mode):
    # A streaming response: each chunk is produced by whichever worker thread serves it.
    def stream():
        with syncs.checking():
            yield "header"
            yield "body"

    gen = stream()
    first, second = concurrent.futures.ThreadPoolExecutor(1), concurrent.futures.ThreadPoolExecutor(1)
    with first, second:
        assert first.submit(next, gen).result(10) == "header"  # enters the region on the first pool's thread
        assert second.submit(next, gen).result(10) == "body"
        with pytest.raises(StopIteration):
            second.submit(next, gen).result(10)  # leaves it on the second pool's thread
    assert _debugmode.armer.count == 0
    assert fake_mode.level == _debugmode.LEVEL_OFF
    assert _backend.backend.regions == 0
    syncs.disable()
    syncs.set_backend("torch")  # not refused: no region is left open
    syncs.set_backend("auto")


def test_a_region_left_elsewhere_is_inert_in_the_context_it_was_entered_in(fake_mode):
    # The thread that entered the region gets back to work after another thread closed it.
    def stream():
        with syncs.checking():
            yield "chunk"

    gen = stream()
    assert next(gen) == "chunk"  # entered here, on this thread
    worker = threading.Thread(target=lambda: list(gen))  # the rest, and the region's exit, on another thread
    worker.start()
    worker.join(10)
    torch_sync_warning()  # no region here any more
    assert not syncs.report(), syncs.report().format()
    assert _debugmode.armer.count == 0


def test_a_reused_allowed_object_entered_twice_leaks_nothing(fake_mode):
    allow = syncs.allowed()

    def recurse(depth: int) -> None:
        with allow:
            if depth:
                recurse(depth - 1)

    with syncs.checking():
        recurse(2)
        torch_sync_warning()  # every allow region has closed
    assert syncs.report().total == 1, syncs.report().format()


def test_a_reused_checking_object_entered_twice_closes_both(fake_mode):
    region = syncs.checking()
    with region:
        with region:
            torch_sync_warning()
        torch_sync_warning()
    torch_sync_warning()  # outside: not checked
    assert syncs.report().total == 2, syncs.report().format()
    assert _debugmode.armer.count == 0 and _hook._installed


def test_a_shared_first_only_object_left_by_its_first_thread_closes_that_threads_allow(fake_mode):
    # One module-level allowed(first_only=True) used by two threads: the first entry allows, the second
    # (a repeat of the site) does not. When the first thread leaves while the second is still inside, it
    # must take back its own entry, not the second thread's empty one, or its later syncs stay allowed.
    once = syncs.allowed(first_only=True)
    second_inside, second_may_leave = threading.Event(), threading.Event()

    def second():
        with syncs.checking(), once:  # the repeat: nothing allowed
            second_inside.set()
            second_may_leave.wait(10)

    with syncs.checking():
        with once:  # the site's first entry: allowed
            worker = threading.Thread(target=second)
            worker.start()
            assert second_inside.wait(10)
        torch_sync_warning()  # this thread's allow region has closed: a violation
        second_may_leave.set()
        worker.join(10)
    assert syncs.report().total == 1, syncs.report().format()


def test_a_shared_checking_object_left_by_its_first_thread_closes_that_threads_region(fake_mode):
    # The same, for checking(): the second thread enters after disable(), so its entry is no region. When
    # the first thread leaves, its own region must close (disarmed), not wait for the second thread's exit.
    region = syncs.checking()
    second_inside, second_may_leave = threading.Event(), threading.Event()

    def second():
        with region:  # the gate is closed: no region
            second_inside.set()
            second_may_leave.wait(10)

    with region:
        syncs.disable()
        worker = threading.Thread(target=second)
        worker.start()
        assert second_inside.wait(10)
    try:
        assert _debugmode.armer.count == 0, "the first thread's region is still armed after it left"
    finally:
        second_may_leave.set()
        worker.join(10)
    assert _debugmode.armer.count == 0

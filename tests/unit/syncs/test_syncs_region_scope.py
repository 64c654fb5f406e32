"""A checked region belongs to the thread and asyncio task that entered it, not to copies of its context.

``asyncio.to_thread``, ``contextvars.copy_context().run`` on another thread
and tasks created inside a region all run in a copy of the region's context;
none of them is checked (while the region is active or after it ended),
unless it enters a region of its own. Both kinds of sync are exercised: an
explicit one (torch's warning, through the hook) and an implicit one (a
pageable ``non_blocking`` copy, through the ``copy_`` wrapper).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from pathlib import Path

import pytest
import torch

from syncless import syncs
from syncless.syncs import _copies
from syncless.syncs._copies import TensorFacts

from .conftest import torch_sync_warning

HERE = Path(__file__).name


@pytest.fixture
def recording(fake_mode, monkeypatch):
    """Record mode; TensorFacts passes as a plain tensor so that the copy check runs on the CPU."""
    plain = _copies._plain_tensor_types()
    monkeypatch.setattr(_copies, "_plain_tensor_types", lambda: (*plain, TensorFacts))
    return fake_mode


def both_syncs() -> None:
    """One explicit and one implicit sync, as seen by the detector."""
    torch_sync_warning()
    gpu = TensorFacts(True, False, False, (3, 4), (4, 1), torch.float32)
    with pytest.raises(TypeError):  # after the check, torch refuses the stand-in for a CUDA tensor
        torch.Tensor.copy_(gpu, torch.randn(3, 4), non_blocking=True)


def _threads() -> set[str]:
    """The threads the recorded syncs happened on (each site is inside both_syncs)."""
    sites = syncs.report().sites
    assert all(s.first.function == "both_syncs" and Path(s.first.filename).name == HERE for s in sites)
    return {s.first.thread for s in sites}


def _run_in_thread(fn) -> None:
    failures = []

    def target():
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test thread below
            failures.append(err)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    if failures:
        raise failures[0]


def test_control_the_region_owner_is_reported(recording):
    with syncs.checking():
        both_syncs()
    assert syncs.report().total == 2 and _threads() == {threading.current_thread().name}


@pytest.mark.parametrize("when", ["active", "ended"])
def test_copy_context_run_on_another_thread_is_not_checked(recording, when):
    with syncs.checking():
        context = contextvars.copy_context()
        if when == "active":
            _run_in_thread(lambda: context.run(both_syncs))
    if when == "ended":
        _run_in_thread(lambda: context.run(both_syncs))
    assert not syncs.report(), syncs.report().format()


@pytest.mark.parametrize("when", ["active", "ended"])
def test_asyncio_to_thread_is_not_checked(recording, when):
    started, release = threading.Event(), threading.Event()

    def worker():
        started.set()
        assert release.wait(30)
        both_syncs()

    async def main():
        with syncs.checking():
            pending = asyncio.ensure_future(asyncio.to_thread(worker))
            assert await asyncio.to_thread(started.wait, 30)
            if when == "active":
                release.set()
                await pending
        if when == "ended":
            release.set()
            await pending

    asyncio.run(main())
    assert not syncs.report(), syncs.report().format()


@pytest.mark.parametrize("when", ["active", "ended"])
def test_a_task_created_in_a_region_is_not_checked(recording, when):
    async def child(go: asyncio.Event):
        await go.wait()
        both_syncs()

    async def main():
        go = asyncio.Event()
        with syncs.checking():
            task = asyncio.create_task(child(go))
            await asyncio.sleep(0)
            if when == "active":
                go.set()
                await task
        if when == "ended":
            go.set()
            await task

    asyncio.run(main())
    assert not syncs.report(), syncs.report().format()


def test_a_thread_that_inherited_a_region_is_checked_in_its_own(recording):
    names = []

    def worker():
        names.append(threading.current_thread().name)
        with syncs.checking():  # its own region, over an inherited one (and an inherited allow region)
            both_syncs()

    with syncs.checking(), syncs.allowed():
        context = contextvars.copy_context()
        _run_in_thread(lambda: context.run(worker))
    assert syncs.report().total == 2 and _threads() == set(names)
    assert names != [threading.current_thread().name]


def test_the_owner_is_still_checked_after_another_thread_used_its_context(recording):
    with syncs.checking():
        context = contextvars.copy_context()
        _run_in_thread(lambda: context.run(both_syncs))
        both_syncs()
    assert syncs.report().total == 2 and _threads() == {threading.current_thread().name}


def test_checked_coroutine_is_checked_across_awaits_in_its_own_task(recording):
    @syncs.checked
    async def step():
        await asyncio.sleep(0)
        both_syncs()
        await asyncio.to_thread(both_syncs)  # another thread: not checked

    asyncio.run(step())
    assert syncs.report().total == 2 and _threads() == {threading.current_thread().name}

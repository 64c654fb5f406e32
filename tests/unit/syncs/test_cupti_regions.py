"""The CUPTI backend where real code enters regions: tasks, threads, ``except`` blocks, long regions.

On the stand-in ``fake_cupti`` (see ``test_cupti_backend.py``): the backend's
bookkeeping of an outermost region, and what it holds back, is the real one.
"""

from __future__ import annotations

import asyncio
import sys
import warnings

import pytest

from syncless import syncs
from syncless._core.errors import SyncViolation

from . import fake_cupti as fake
from .test_cupti_backend import cupti_env, enabled, here  # noqa: F401 - the fixture

THIS = __file__


def cupti_only_sync() -> int:
    """A sync only CUPTI sees (a driver wait made by a C extension); returns its line."""
    line = here()
    fake.call("cuStreamSynchronize", [0])
    return line


@pytest.mark.parametrize("how", ["to_thread", "create_task"])
def test_a_region_inside_a_task_or_thread_started_from_a_region_is_closed(cupti_env, how):
    # docs/syncs.md: "enter a region inside the task". Its depth restarts at 1 in the copied context; on exit it
    # went back to the inherited 1, not 0, so its held-back events were never recorded (nor raised).
    syncs.set_mode("error")
    enabled(cupti_env)
    lines = []

    @syncs.checked
    def checked_fn():
        lines.append(cupti_only_sync())

    async def checked_coro():
        checked_fn()

    async def main():
        with syncs.checking():
            if how == "to_thread":
                await asyncio.to_thread(checked_fn)
            else:
                await asyncio.create_task(checked_coro())

    with pytest.raises(SyncViolation, match="cuStreamSynchronize"):
        asyncio.run(main())
    assert [(s.first.lineno, s.count) for s in syncs.report().sites] == [(lines[0], 1)]


def test_a_checked_call_from_an_except_block_raises_its_violation(cupti_env):
    # A retry path: the caller is handling an exception when it calls the checked function.
    syncs.set_mode("error")
    enabled(cupti_env)

    @syncs.checked
    def retry():
        cupti_only_sync()
        return "done"

    @syncs.checked
    async def retry_async():
        cupti_only_sync()

    try:
        raise KeyError("first attempt failed")
    except KeyError:
        with pytest.raises(SyncViolation, match="cuStreamSynchronize"):
            retry()
        with pytest.raises(SyncViolation, match="cuStreamSynchronize"):
            asyncio.run(retry_async())


def _held_back():
    """The CUPTI events held back in this thread's outermost region now."""
    from syncless.syncs import _report

    return _report.region_events.get()


def _cupti_only_sync_keeping_frame(kept: list) -> int:
    """:func:`cupti_only_sync` whose frame stays alive, so the next call's frame gets a new id."""
    kept.append(sys._getframe())
    line = here()
    fake.call("cuStreamSynchronize", [0])
    return line


def test_a_loop_whose_calls_get_new_frame_ids_still_holds_one_entry(cupti_env):
    # A flaky CI run held 1999 of 2000 repeats: the first call's frame had another id than the later ones (ids are
    # reused only when the allocator happens to), and a change of call key recorded what was held.
    enabled(cupti_env)
    kept: list = []
    with syncs.checking():
        for _ in range(50):
            line = _cupti_only_sync_keeping_frame(kept)
        events = _held_back()
        assert len(events.pending) == 1 and events.pending[0].repeats == 50
        assert [(s.first.lineno, s.count) for s in syncs.report().sites] == [(line, 50)]


def test_a_long_region_holds_one_entry_and_one_stack_per_call_site(cupti_env):
    # CUPTI-only syncs are held back until something else happens on the thread; a server's checked loop
    # held 10,000 of them, each with its own formatted stack, and recorded none until the region ended.
    enabled(cupti_env)
    with syncs.checking():
        for _ in range(2000):
            line = cupti_only_sync()
        events = _held_back()
        assert len(events.pending) == 1 and events.pending[0].repeats == 2000
        assert sum(bool(v.stack) for v in events.pending) == 1
        during = syncs.report()  # a report taken during the region counts them all
        assert [(s.first.lineno, s.count) for s in during.sites] == [(line, 2000)]
        for _ in range(500):
            cupti_only_sync()
    (site,) = syncs.report().sites
    assert (site.first.lineno, site.count, site.api_calls, site.timed_count) == (
        line, 2500, {"cuStreamSynchronize": 2500}, 2500)
    assert site.blocked_max_ns <= site.blocked_total_ns


def test_calls_held_for_a_wrapper_stay_one_entry(cupti_env):
    enabled(cupti_env)
    with syncs.checking():
        for _ in range(300):
            with syncs.allowed():
                fake.call("cuStreamSynchronize", [0])  # allowed, and no wrapper's report claims it
        assert len(_held_back().joins) == 1
    assert not syncs.report()


def test_an_error_filter_on_sync_warnings_loses_no_cupti_sync(cupti_env):
    # filterwarnings=error: the flush's first warning raised inside the CUPTI callback, and the rest of the
    # batch was dropped (1 of 4 syncs recorded).
    syncs.set_mode("warn")
    enabled(cupti_env)
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", syncs.SyncWarning)
        with pytest.raises(syncs.SyncWarning, match="cuStreamSynchronize"):  # raised where it may be: the exit
            with syncs.checking():
                lines.append(here())
                fake.call("cuStreamSynchronize", [0])
                lines.append(here())
                fake.call("cuEventSynchronize", [0])
                lines.append(here())
                fake.call("cuCtxSynchronize")
                lines.append(here())
                fake.call("cuMemFreeHost", [fake.PINNED_ADDR])
                reached = True
    assert reached  # no CUDA call raised
    assert sorted(s.first.lineno for s in syncs.report().sites) == lines

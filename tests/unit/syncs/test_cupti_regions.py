"""The CUPTI backend where real code enters regions: tasks, threads, ``except`` blocks, long regions.

On the stand-in ``fake_cupti`` (see ``test_cupti_backend.py``): the backend's
bookkeeping of an outermost region, and what it holds back, is the real one.
"""

from __future__ import annotations

import asyncio
import sys
import tracemalloc

import pytest

from syncless import syncs
from syncless._core.errors import SyncViolation
from syncless.syncs import _merge

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

"""The plugin where suites run: pytest-xdist (``-n``) and pytest-asyncio (``async def`` tests).

Run through pytester in a subprocess, with the fake debug-mode switch and
torch's warning issued by hand (as in ``test_syncs_plugin.py``).
"""

from __future__ import annotations

import pytest

from .test_syncs_plugin import FAKE_CONFTEST, PLUGIN, isolated  # noqa: F401 - the fixture

SYNCING_MODULE = """
import pytest
from conftest import sync

@pytest.mark.sync_checked
def test_syncs_{n}():
    sync()

@pytest.mark.sync_checked
def test_quiet_{n}():
    assert True
"""


def _xdist_project(pytester):
    pytester.makeconftest(FAKE_CONFTEST)
    pytester.makepyfile(**{f"test_mod{n}": SYNCING_MODULE.format(n=n) for n in range(2)})


@pytest.mark.parametrize("mode", ["record", "warn"])
def test_under_xdist_the_summary_gathers_the_workers_records(pytester, isolated, mode):
    pytest.importorskip("xdist")
    _xdist_project(pytester)
    serial = pytester.runpytest_subprocess(*PLUGIN, f"--sync-check={mode}", "-W", "ignore::UserWarning")
    serial.assert_outcomes(passed=4)
    serial.stdout.fnmatch_lines(["*2 hidden GPU sync(s) at 2 call site(s)*"])
    spread = pytester.runpytest_subprocess(*PLUGIN, "-p", "xdist", "-n", "2", f"--sync-check={mode}",
                                           "-W", "ignore::UserWarning")
    spread.assert_outcomes(passed=4)
    out = spread.stdout.str()
    assert "no hidden GPU syncs recorded" not in out and "NOTHING WAS CHECKED" not in out, out
    spread.stdout.fnmatch_lines(["*gathered from 2 pytest-xdist worker(s)*",
                                 "*2 hidden GPU sync(s) at 2 call site(s)*"])
    assert "test_mod0.py:6" in out and "test_mod1.py:6" in out


ASYNC_TESTS = """
import asyncio
import pytest
from conftest import sync

@pytest.mark.asyncio
@pytest.mark.sync_checked
async def test_async_syncs():
    await asyncio.sleep(0)
    sync()

@pytest.mark.asyncio
@pytest.mark.sync_checked
async def test_async_quiet():
    await asyncio.sleep(0)

@pytest.mark.asyncio
async def test_async_unmarked():
    sync()
"""


def test_async_tests_marked_sync_checked_are_checked_in_their_task(pytester, isolated):
    pytest.importorskip("pytest_asyncio")
    pytester.makeconftest(FAKE_CONFTEST)
    pytester.makepyfile(test_async=ASYNC_TESTS)
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "asyncio", "--sync-check=error", "-W",
                                           "ignore::UserWarning", "-o", "asyncio_default_fixture_loop_scope=function")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*SyncViolation: hidden GPU sync in a checked region at *test_async.py:9 "
                                 "(in test_async_syncs)*"])

"""Regions, allow regions, threads and tasks, the hook's decisions, and the three modes.

torch's debug mode is faked (there is no CUDA here); the warnings are exactly
what torch issues, so the hook decides as it would on a GPU.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from syncless import syncs
from syncless._core import patching
from syncless.syncs import SyncViolation, SyncWarning, _debugmode, _hook

from .conftest import TORCH_TEXT, torch_sync_warning

HERE = Path(__file__).name


def _line() -> int:
    return sys._getframe(1).f_lineno


def _sites():
    return {(Path(s.first.filename).name, s.first.lineno): s.count for s in syncs.report().sites}


def test_regions_nest_and_restore_the_previous_debug_mode(fake_mode):
    fake_mode.level = _debugmode.LEVEL_ERROR  # what the user had set
    with syncs.checking():
        assert fake_mode.level == _debugmode.LEVEL_WARN
        with syncs.checking():
            assert fake_mode.level == _debugmode.LEVEL_WARN
        assert fake_mode.level == _debugmode.LEVEL_WARN
    assert fake_mode.level == _debugmode.LEVEL_ERROR
    assert fake_mode.history == [_debugmode.LEVEL_WARN, _debugmode.LEVEL_ERROR]


def test_arming_is_counted_across_threads(fake_mode):
    inside, release = threading.Event(), threading.Event()

    def worker():
        with syncs.checking():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=worker)
    with syncs.checking():
        thread.start()
        assert inside.wait(10)
    # The main thread left; the worker's region keeps the mode armed.
    assert fake_mode.level == _debugmode.LEVEL_WARN
    release.set()
    thread.join(10)
    assert fake_mode.level == _debugmode.LEVEL_OFF
    assert fake_mode.history == [_debugmode.LEVEL_WARN, _debugmode.LEVEL_OFF]


def test_a_sync_is_reported_at_the_users_line_only_inside_a_region(fake_mode):
    torch_sync_warning_outside = _line() + 1
    torch_sync_warning()
    with syncs.checking():
        inside = _line() + 1
        torch_sync_warning()
    assert _sites() == {(HERE, inside): 1}
    assert torch_sync_warning_outside not in [line for _, line in _sites()]
    site = syncs.report().sites[0].first
    assert site.function == "test_a_sync_is_reported_at_the_users_line_only_inside_a_region"
    assert "torch_sync_warning()" in site.operation
    assert "allowed()" in site.fix


def test_checked_decorator_and_async_functions(fake_mode):
    @syncs.checked
    def step():
        torch_sync_warning()
        return 7

    @syncs.checked
    async def astep():
        await asyncio.sleep(0)
        torch_sync_warning()  # after an await: still inside the task's region
        return 8

    assert step() == 7
    assert asyncio.run(astep()) == 8
    assert sorted(_sites().values()) == [1, 1]
    assert fake_mode.level == _debugmode.LEVEL_OFF


def test_repeats_are_not_deduplicated_and_the_hook_survives_catch_warnings(fake_mode):
    # What pytest does around every test: put back the stdlib showwarning and
    # a copy of the filters with a "default" action (show once per line) in front.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        assert warnings.showwarning is not _hook.showwarning
        with syncs.checking():
            for _ in range(3):
                line = _line() + 1
                torch_sync_warning()
    assert _sites() == {(HERE, line): 3}
    assert seen == []  # record mode: silent


def test_allowed_lets_syncs_through_on_this_thread(fake_mode):
    with syncs.checking():
        with syncs.allowed():
            torch_sync_warning()
            with syncs.checking():  # an allow region covers nested regions too
                torch_sync_warning()
        line = _line() + 1
        torch_sync_warning()
    assert _sites() == {(HERE, line): 1}


def _first_only_site():
    with syncs.allowed(first_only=True):
        torch_sync_warning()


def test_first_only_allows_the_first_entry_per_call_site(fake_mode):
    with syncs.checking():
        _first_only_site()
        _first_only_site()
        _first_only_site()
    sites = syncs.report().sites
    assert len(sites) == 1 and sites[0].count == 2
    assert sites[0].first.function == "_first_only_site"


def test_first_only_counts_two_call_sites_separately(fake_mode):
    with syncs.checking():
        for _ in range(1):
            with syncs.allowed(first_only=True):
                torch_sync_warning()
            with syncs.allowed(first_only=True):
                torch_sync_warning()
    assert not syncs.report()
    syncs.reset()  # forgets the sites: they allow once more
    with syncs.checking(), syncs.allowed(first_only=True):
        torch_sync_warning()
    assert not syncs.report()


def test_another_thread_is_never_reported(fake_mode):
    done = threading.Event()

    def worker():
        torch_sync_warning()  # a sync on an unchecked thread while main is checked
        done.set()

    with syncs.checking():
        thread = threading.Thread(target=worker)
        thread.start()
        assert done.wait(10)
        thread.join(10)
    assert not syncs.report()


def test_an_allow_region_on_one_thread_does_not_disarm_another(fake_mode):
    allowing, synced = threading.Event(), threading.Event()

    def worker():
        with syncs.checking(), syncs.allowed():
            allowing.set()
            synced.wait(10)
            torch_sync_warning()

    thread = threading.Thread(target=worker)
    with syncs.checking():
        thread.start()
        assert allowing.wait(10)
        line = _line() + 1
        torch_sync_warning()
        synced.set()
        thread.join(10)
    assert _sites() == {(HERE, line): 1}


def test_asyncio_tasks_have_their_own_regions(fake_mode):
    lines = {}

    async def hot():
        with syncs.checking():
            await asyncio.sleep(0.01)  # the other task runs while this region is open
            lines["hot"] = _line() + 1
            torch_sync_warning()

    async def cold():
        await asyncio.sleep(0)
        torch_sync_warning()

    async def main():
        await asyncio.gather(hot(), cold())

    asyncio.run(main())
    assert _sites() == {(HERE, lines["hot"]): 1}


def test_error_mode_raises_with_site_and_fix(fake_mode):
    syncs.set_mode("error")
    with pytest.raises(SyncViolation) as caught:
        with syncs.checking():
            line = _line() + 1
            torch_sync_warning()
    text = str(caught.value)
    assert f"{HERE}:{line}" in text
    assert "Fix:" in text and "allowed()" in text
    assert caught.value.violation.lineno == line
    assert fake_mode.level == _debugmode.LEVEL_OFF  # the region was left cleanly


def test_warn_mode_warns_at_the_users_line(fake_mode):
    syncs.set_mode("warn")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with syncs.checking():
            line = _line() + 1
            torch_sync_warning()
    ours = [w for w in seen if issubclass(w.category, SyncWarning)]
    assert len(ours) == 1
    assert Path(ours[0].filename).name == HERE and ours[0].lineno == line
    assert not [w for w in seen if str(w.message).startswith(_hook.TORCH_SYNC_TEXT)]


def test_other_warnings_pass_through_the_hook(fake_mode):
    with syncs.checking(), pytest.warns(DeprecationWarning, match="unrelated"):
        warnings.warn("unrelated", DeprecationWarning)
    assert not syncs.report()


def test_decide_on_torch_text_directly(fake_mode):
    assert _hook.decide(TORCH_TEXT, UserWarning) is None  # no region
    with syncs.checking():
        here = sys._getframe()
        violation = _hook.decide(TORCH_TEXT, UserWarning, here)
        assert violation is not None and violation.lineno == here.f_lineno - 1
        assert _hook.decide("called something else", UserWarning, here) is None
        assert _hook.decide(TORCH_TEXT, DeprecationWarning, here) is None
        with syncs.allowed():
            assert _hook.decide(TORCH_TEXT, UserWarning, here) is None


def test_composes_with_a_lower_layer_in_either_order(restored_globals):
    calls = []

    def lower(beneath):
        def copy_(self, *args, **kwargs):
            calls.append(1)
            return beneath(self, *args, **kwargs)

        copy_.__name__ = "copy_"
        return copy_

    original = torch.Tensor.copy_
    with _debugmode.fake():
        syncs.set_mode("record")
        for detector_first in (True, False):
            if detector_first:
                assert syncs.enable()
            patching.add_layer(torch.Tensor, "copy_", "test-lower", patching.RANK_CC_SHIM, lower)
            if not detector_first:
                assert syncs.enable()
            src = torch.randn(4)
            dst = torch.full((4,), float("nan"))
            with syncs.checking():
                dst.copy_(src)
            assert torch.equal(dst, src) and len(calls) == 1
            calls.clear()
            if detector_first:
                syncs.disable()
                assert patching.beneath(torch.Tensor, "copy_", "test-lower") is original
                patching.remove_layer(torch.Tensor, "copy_", "test-lower")
            else:
                patching.remove_layer(torch.Tensor, "copy_", "test-lower")
                syncs.disable()
            assert torch.Tensor.copy_ is original


@pytest.mark.parametrize("mode", ["off", "error"])
def test_checked_refuses_generator_functions_whose_body_would_escape(mode, monkeypatch):
    from syncless import syncs
    from syncless.syncs._state import settings

    monkeypatch.setattr(settings, "mode", mode)

    def tokens():
        yield 1

    async def atokens():
        yield 1

    for fn in (tokens, atokens):
        with pytest.raises(TypeError, match="generator function .*checking"):
            syncs.checked(fn)

"""The torch layer inside ``warnings.catch_warnings`` blocks, and the user's filters for ``SyncWarning``.

Libraries hush their own warnings with ``catch_warnings`` + ``simplefilter``;
tests record warnings (``record=True``, ``pytest.warns``); a hot loop may
have a once-per-line warning of its own. None of it may change what the
detector sees, and the detector may not change what the user's code sees.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from syncless import syncs
from syncless._core.errors import SyncViolation
from syncless.syncs import _debugmode

from .conftest import torch_sync_warning

HERE = Path(__file__).name


def here() -> int:
    return sys._getframe(1).f_lineno + 1


def sites():
    return [(Path(s.first.filename).name, s.first.lineno, s.count) for s in syncs.report().sites]


@pytest.mark.parametrize("action", ["ignore", "error", "default"])
def test_a_simplefilter_inside_the_region_does_not_hide_the_sync(fake_mode, action):
    with syncs.checking():
        with warnings.catch_warnings():
            warnings.simplefilter(action)
            line = here()
            torch_sync_warning()  # under "error", torch's warning raised UserWarning out of the op
    assert sites() == [(HERE, line, 1)]


def test_a_recording_catch_warnings_sees_no_torch_warning_and_the_sync_is_seen(fake_mode):
    with syncs.checking():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            line = here()
            torch_sync_warning()
            warnings.warn("the user's own", UserWarning)
    assert sites() == [(HERE, line, 1)]
    assert [str(w.message) for w in seen] == ["the user's own"]


def test_under_pytest_warns_the_site_is_the_users_line(fake_mode):
    with syncs.checking():
        with pytest.warns(UserWarning, match="mine"):
            line = here()
            torch_sync_warning()
            warnings.warn("mine", UserWarning)
    assert sites() == [(HERE, line, 1)]  # was _pytest/recwarn.py, where pytest re-issues what it did not match


def test_error_mode_still_raises_under_an_ignore_filter(fake_mode):
    syncs.set_mode("error")
    with pytest.raises(SyncViolation):
        with syncs.checking(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch_sync_warning()


def test_a_once_per_line_warning_in_the_hot_loop_stays_once(restored_globals, monkeypatch):
    # torch's own switch (faked under it: a CPU build has none), as TorchDebugMode.set calls it.
    level = [0]

    def set_level(new):
        level[0] = new
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations", UserWarning)

    class Switch(_debugmode.TorchDebugMode):
        def unavailable_reason(self):
            return None

    switch = Switch()
    switch._get, switch._set = (lambda: level[0]), set_level
    monkeypatch.setattr(_debugmode, "_backend", switch)
    syncs.set_mode("record")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        assert syncs.enable()
        for _ in range(4):
            with syncs.checking():
                pass
            warnings.warn("once per line", UserWarning)
        syncs.disable()
    assert [str(w.message) for w in seen] == ["once per line"]  # 4 before: every arm reset the registries
    assert level[0] == 0


@pytest.mark.parametrize("action", ["error", "ignore"])
def test_warn_mode_honours_the_users_filters_for_sync_warning(fake_mode, action):
    syncs.set_mode("warn")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.simplefilter(action, syncs.SyncWarning)
        with syncs.checking():
            if action == "error":
                with pytest.raises(syncs.SyncWarning, match="hidden GPU sync"):
                    line = here()
                    torch_sync_warning()
            else:
                line = here()
                torch_sync_warning()
    assert not [w for w in seen if issubclass(w.category, syncs.SyncWarning)]
    assert sites() == [(HERE, line, 1)]


def test_warn_mode_warning_reaches_a_recording_block(fake_mode):
    syncs.set_mode("warn")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with syncs.checking():
            line = here()
            torch_sync_warning()
    (ours,) = seen
    assert ours.category is syncs.SyncWarning and ours.lineno == line and Path(ours.filename).name == HERE


def test_a_users_error_level_raises_under_an_ignore_filter_as_torchs_own_would(fake_mode):
    fake_mode.level = _debugmode.LEVEL_ERROR  # the user's torch.cuda.set_sync_debug_mode("error")
    with syncs.checking(), syncs.allowed():  # allowed: not ours to report, the user's level decides
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
                torch_sync_warning()
    assert fake_mode.level == _debugmode.LEVEL_ERROR and not syncs.report()


def test_a_filter_that_cannot_catch_torchs_warning_keeps_its_place_in_front():
    """Review: every filterwarnings() moved syncless's entry in front of the user's, so the idiom
    ``filterwarnings(...); ...; filters.pop(0)`` removed ours and left the user's filter for good."""
    from syncless.syncs import _hook

    _hook.install()
    try:
        warnings.filterwarnings("ignore", message="my noisy thing")
        assert getattr(warnings.filters[0][1], "pattern", None) == "my noisy thing"
        warnings.filters.pop(0)
        assert not [f for f in warnings.filters if getattr(f[1], "pattern", None) == "my noisy thing"]
        warnings.simplefilter("ignore")  # this one could hide torch's warning: ours goes back in front of it
        assert warnings.filters[0] is _hook._filter_entry
        warnings.filters.remove(("ignore", None, Warning, None, 0))
    finally:
        _hook.uninstall()


def test_another_librarys_wrapper_over_ours_survives_disable_and_enable():
    """Review: a library wrapped warnings._showwarnmsg over ours; after uninstall (ours stays beneath it) and
    install, ours saved that wrapper as its original and every warning recursed."""
    from syncless.syncs import _hook

    _hook.install()
    beneath = warnings._showwarnmsg
    shown = []

    def library_wrapper(msg):
        shown.append(str(msg.message))
        return beneath(msg)

    warnings._showwarnmsg = library_wrapper
    try:
        _hook.uninstall()
        _hook.install()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("hello from the user")  # RecursionError before the fix
        assert shown == ["hello from the user"]
    finally:
        _hook.uninstall()
        warnings._showwarnmsg = beneath
        _hook.install()
        _hook.uninstall()
    assert warnings._showwarnmsg is not _hook._showwarnmsg

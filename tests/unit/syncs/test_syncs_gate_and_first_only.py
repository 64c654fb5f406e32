"""The gate and the mode decide at the moment of the sync; first-only sites count only entries while enabled."""

from __future__ import annotations

import pytest

from syncless import syncs
from syncless.syncs import _debugmode

from .conftest import torch_sync_warning


def test_switching_the_mode_off_inside_a_region_stops_checking(fake_mode):
    with syncs.checking():
        syncs.set_mode("off")
        torch_sync_warning()  # not judged: nothing recorded
        syncs.set_mode("record")
        torch_sync_warning()  # judged again (so the hook was in place all along)
    assert syncs.report().total == 1


def _first_only_site():
    with syncs.allowed(first_only=True):
        torch_sync_warning()


def test_first_only_entries_before_enable_do_not_use_up_the_site(restored_globals):
    with _debugmode.fake():
        syncs.set_mode("record")
        syncs.reset()
        with pytest.warns(UserWarning, match="synchronizing"):
            _first_only_site()  # the gate is closed: nothing is decided, nothing is used up
        assert syncs.enable()
        with syncs.checking():
            _first_only_site()  # the first entry while enabled: allowed
            _first_only_site()  # a repeat: reported
        assert syncs.report().total == 1
        syncs.disable()


def test_reset_lets_the_same_first_only_site_allow_once_more(fake_mode):
    with syncs.checking():
        _first_only_site()  # allowed
        syncs.reset()
        _first_only_site()  # allowed again after reset
    assert not syncs.report()
    with syncs.checking():
        _first_only_site()  # a repeat since the reset: reported
    assert syncs.report().total == 1


@pytest.mark.parametrize("mode, prints", [("record", True), ("warn", False), ("error", False)])
def test_enable_arranges_the_exit_report_in_record_mode_only(restored_globals, monkeypatch, mode, prints):
    arranged = []
    monkeypatch.setattr(syncs.recorder, "print_at_exit", lambda: arranged.append(True))
    with _debugmode.fake():
        syncs.set_mode(mode)
        assert syncs.enable()
        assert syncs.enable()  # idempotent: arranged at most once
        syncs.disable()
    assert arranged == ([True] if prints else [])

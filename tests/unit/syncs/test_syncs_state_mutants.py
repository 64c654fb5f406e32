"""The gate and the mode decide at the moment of the sync; first-only sites count only entries while enabled."""

from __future__ import annotations

import pytest

from syncless import syncs
from syncless.syncs import _debugmode

from .conftest import torch_sync_warning


def test_switching_the_mode_off_inside_a_region_stops_checking(fake_mode):
    with syncs.checking():
        syncs.set_mode("off")
        with pytest.warns(UserWarning, match="synchronizing"):
            torch_sync_warning()  # not ours to judge any more: it goes its usual way
    assert not syncs.report()


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

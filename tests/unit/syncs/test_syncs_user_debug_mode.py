"""The user's own torch sync debug mode and showwarning survive the detector.

torch's behaviour is the oracle: at level "error" torch raises
``RuntimeError("called a synchronizing CUDA operation")`` for a sync on any
thread; a level the user sets is the level in force afterwards; a showwarning
a library installs stays installed until that library removes it. On this
CPU build the debug-mode switch is faked and torch's warning is issued as
torch issues it (:data:`conftest.torch_sync_warning`).
"""

from __future__ import annotations

import io
import logging
import threading
import warnings

import pytest

from syncless import syncs
from syncless.syncs import _debugmode, _hook

from .conftest import torch_sync_warning


def _on_another_thread(fn):
    """Run ``fn`` on a fresh thread (outside every region); return what it raised, or None."""
    raised = []

    def run():
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - what the thread saw is the outcome under test
            raised.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    return raised[0] if raised else None


def _enabled(level: int):
    fake = _debugmode.fake(level)
    switch = fake.__enter__()
    syncs.set_mode("record")
    assert syncs.enable()
    return fake, switch


def test_a_users_error_level_still_raises_torchs_error_on_other_threads(restored_globals):
    fake, _ = _enabled(_debugmode.LEVEL_ERROR)
    try:
        with syncs.checking():
            err = _on_another_thread(torch_sync_warning)
        assert type(err) is RuntimeError and str(err) == _hook.TORCH_SYNC_TEXT
    finally:
        syncs.disable()
        fake.__exit__(None, None, None)


@pytest.mark.parametrize("before, set_inside", [(_debugmode.LEVEL_ERROR, _debugmode.LEVEL_OFF),
                                                (_debugmode.LEVEL_OFF, _debugmode.LEVEL_ERROR)])
def test_a_level_the_user_sets_inside_a_region_stays_after_it(before, set_inside, restored_globals):
    fake, switch = _enabled(before)
    try:
        with syncs.checking():
            switch.set(set_inside)  # torch.cuda.set_sync_debug_mode(...)
        assert switch.level == set_inside
    finally:
        syncs.disable()
        fake.__exit__(None, None, None)


def test_disable_inside_a_region_keeps_torchs_raw_warnings_away_until_it_closes(restored_globals):
    fake, switch = _enabled(_debugmode.LEVEL_OFF)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            with syncs.checking():
                syncs.disable()
                assert switch.level == _debugmode.LEVEL_WARN  # the open region keeps it armed
                assert _on_another_thread(torch_sync_warning) is None
                torch_sync_warning()
            assert switch.level == _debugmode.LEVEL_OFF
            assert warnings.showwarning is not _hook.showwarning
        assert [str(w.message) for w in seen] == []  # the user never turned the debug mode on
    finally:
        syncs.disable()
        fake.__exit__(None, None, None)


def test_a_showwarning_installed_after_enable_stays_and_ours_never_comes_back(restored_globals):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    py_warnings = logging.getLogger("py.warnings")
    py_warnings.addHandler(handler)
    delivered = []
    outer = warnings.showwarning

    def users_showwarning(message, *args, **kwargs):
        delivered.append(str(message))

    warnings.showwarning = users_showwarning
    fake, _ = _enabled(_debugmode.LEVEL_OFF)
    try:
        logging.captureWarnings(True)
        with syncs.checking():
            pass
        syncs.disable()
        warnings.warn("probe-after-disable", UserWarning)
        assert "probe-after-disable" in stream.getvalue()  # still captured by logging
        logging.captureWarnings(False)  # logging puts back the showwarning it found: ours, released
        warnings.warn("probe-after-capture", UserWarning)
        assert delivered == ["probe-after-capture"] and "probe-after-capture" not in stream.getvalue()
        assert warnings.showwarning is users_showwarning
    finally:
        logging.captureWarnings(False)
        py_warnings.removeHandler(handler)
        syncs.disable()
        fake.__exit__(None, None, None)
        warnings.showwarning = outer


def test_a_disable_between_a_regions_gate_and_its_arming_leaves_nothing_behind(monkeypatch):
    """Found in review: ``disable()`` on another thread after ``checking()`` passed its gate and before it armed
    released the hook, and the region then put the hook and our warnings filter back for good."""
    import re
    import threading
    import warnings

    from syncless import syncs
    from syncless.syncs import _debugmode, _hook, _state

    with _debugmode.fake():
        syncs.set_mode("record")
        assert syncs.enable()
        entering = _state._enter

        def enter_while_another_thread_disables(depth, owner):
            other = threading.Thread(target=syncs.disable)
            other.start()
            other.join()
            return entering(depth, owner)

        monkeypatch.setattr(_state, "_enter", enter_while_another_thread_disables)
        with syncs.checking():
            monkeypatch.setattr(_state, "_enter", entering)
            assert warnings.showwarning is not _hook.showwarning
        assert _debugmode.armer.count == 0
        ours = re.escape(_hook.TORCH_SYNC_TEXT)
        assert not any(getattr(f[1], "pattern", None) == ours for f in warnings.filters)
        assert warnings.showwarning is not _hook.showwarning

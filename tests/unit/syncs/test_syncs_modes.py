"""Modes, the environment variable, the enable gate, and the free path when off."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from syncless import syncs
from syncless._core import config
from syncless._core.errors import ConfigError
from syncless._core.logs import forget_logged
from syncless.syncs import _debugmode, _hook, _state

from .conftest import patched_attributes, torch_sync_warning


@pytest.mark.parametrize("text, expected", [("off", "off"), ("warn", "warn"), ("ERROR", "error"), (" record ", "record")])
def test_env_variable_sets_the_mode(monkeypatch, text, expected):
    monkeypatch.setenv("SYNCLESS_SYNC_CHECK", text)
    assert _state._Settings().mode == expected


def test_bad_env_value_names_variable_and_allowed_values(monkeypatch):
    monkeypatch.setenv("SYNCLESS_SYNC_CHECK", "loud")
    with pytest.raises(ConfigError, match=r"SYNCLESS_SYNC_CHECK='loud'.*off, warn, error, record"):
        config.read("SYNCLESS_SYNC_CHECK")


def test_env_is_read_once_at_import(monkeypatch, restored_globals):
    before = syncs.mode()
    monkeypatch.setenv("SYNCLESS_SYNC_CHECK", "error" if before != "error" else "warn")
    assert syncs.mode() == before


def test_set_mode_validates(restored_globals):
    with pytest.raises(ValueError, match=r"one of off, warn, error, record; got 'loud'"):
        syncs.set_mode("loud")
    with pytest.raises(TypeError, match="got int"):
        syncs.set_mode(1)
    syncs.set_mode("warn")
    assert syncs.mode() == "warn"


def test_off_is_free(restored_globals):
    syncs.set_mode("off")

    def step():
        return 1

    assert syncs.checked(step) is step
    assert syncs.allowed() is syncs.allowed(first_only=True)
    assert syncs.checking() is syncs.allowed()
    before = [getattr(owner, name) for owner, name in patched_attributes()]
    with _debugmode.fake() as fake:
        assert syncs.enable() is False
        assert not syncs.is_enabled()
        with pytest.warns(UserWarning, match="synchronizing"), syncs.checking():
            torch_sync_warning()  # not ours to judge: it goes its usual way
        assert fake.history == []
    assert not syncs.report()
    assert [getattr(owner, name) for owner, name in patched_attributes()] == before
    assert warnings.showwarning is not _hook.showwarning


def test_nothing_is_checked_before_enable(restored_globals):
    with _debugmode.fake() as fake:
        syncs.set_mode("record")
        syncs.reset()

        @syncs.checked
        def step():
            torch_sync_warning()

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step()
        assert not syncs.report()
        assert fake.history == []  # the debug mode was never armed
        assert len(seen) == 1  # and the warning went its usual way

        assert syncs.enable()
        step()
        assert syncs.report().total == 1
        assert fake.history == [_debugmode.LEVEL_WARN, _debugmode.LEVEL_OFF]


def test_enable_without_cuda_says_once_that_there_is_nothing_to_check(restored_globals, caplog):
    if _debugmode.TorchDebugMode().unavailable_reason() is None:
        pytest.skip("this machine has a CUDA sync debug mode")
    syncs.set_mode("error")
    forget_logged("syncs-")
    originals = [getattr(owner, name) for owner, name in patched_attributes()]
    with caplog.at_level(logging.WARNING, logger="syncless.syncs"):
        assert syncs.enable() is False
        assert syncs.enable() is False
    said = [r for r in caplog.records if "nothing to check" in r.getMessage()]
    assert len(said) == 1
    assert [getattr(owner, name) for owner, name in patched_attributes()] == originals
    with pytest.warns(UserWarning, match="synchronizing"), syncs.checking():
        torch_sync_warning()
    assert not syncs.report()


def test_enable_and_disable_restore_every_patched_attribute(restored_globals):
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched_attributes()]
    show_before = warnings.showwarning
    with _debugmode.fake():
        syncs.set_mode("warn")
        assert syncs.enable()
        assert syncs.enable()  # idempotent
        assert all(getattr(owner, name) is not original for owner, name, original in originals)
        assert warnings.showwarning is _hook.showwarning
        syncs.disable()
    assert all(getattr(owner, name) is original for owner, name, original in originals)
    assert warnings.showwarning is show_before


def test_wrapped_methods_keep_their_names(fake_mode):
    # dynamo treats a bound method named like a tensor method as that method.
    assert torch.Tensor.to.__name__ == "to"
    assert torch.Tensor.copy_.__name__ == "copy_"
    assert torch.Tensor.cuda.__name__ == "cuda"
    x = torch.randn(5)
    y = torch.empty(5).fill_(float("nan"))
    assert y.copy_(x) is y and torch.equal(y, x)
    assert torch.equal(x.to(torch.float64), x.double())

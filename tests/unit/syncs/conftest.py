"""Fixtures for the detector's CPU tests: a fake debug-mode switch, and nothing leaked."""

from __future__ import annotations

import functools
import re
import warnings

import pytest

from syncless import syncs
from syncless.syncs import _debugmode, _hook

TORCH_TEXT = _hook.TORCH_SYNC_TEXT + " (Triggered internally at c10/cuda/CUDAFunctions.cpp:1.)"


def patched_attributes():
    """(owner, name) of every attribute enable() may patch."""
    import torch

    pairs = [(torch.Tensor, "to"), (torch.Tensor, "cuda"), (torch.Tensor, "copy_"), (torch.cuda, "synchronize"),
             (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
    if hasattr(getattr(torch, "accelerator", None), "synchronize"):
        pairs.append((torch.accelerator, "synchronize"))
    return pairs


# Issue exactly what torch issues for a sync in debug mode "warn": a UserWarning
# raised from C code called on the user's line (functools.partial and the
# warnings module's C implementation push no Python frame, like a torch op).
torch_sync_warning = functools.partial(warnings.warn, TORCH_TEXT, UserWarning)


@pytest.fixture
def restored_globals():
    """Check after the test that torch, warnings and the detector are as before."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched_attributes()]
    warnings_module = (warnings._showwarnmsg, warnings.simplefilter.__globals__["_add_filter"])
    mode_before = syncs.mode()
    yield
    syncs.disable()
    syncs.reset()
    syncs.set_mode(mode_before)
    for owner, name, original in originals:
        assert getattr(owner, name) is original, f"{owner}.{name} was not restored"
    assert warnings.showwarning is not _hook.showwarning
    assert (warnings._showwarnmsg, warnings.simplefilter.__globals__["_add_filter"]) == warnings_module
    ours = re.escape(_hook.TORCH_SYNC_TEXT)
    assert all(entry[1] is None or entry[1].pattern != ours for entry in warnings.filters)
    assert _debugmode.armer.count == 0


@pytest.fixture
def fake_mode(restored_globals):
    """The detector in record mode on a fake debug-mode switch (level 0 before)."""
    with _debugmode.fake() as fake:
        syncs.set_mode("record")
        syncs.reset()
        assert syncs.enable()
        yield fake
        syncs.disable()

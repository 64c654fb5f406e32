"""The hidden-sync detector put back after a GPU test, whatever the test did to it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from syncless import syncs


@contextlib.contextmanager
def detector_put_back() -> Iterator[None]:
    """Afterwards the detector is disabled and reset, its mode is as before, and so is torch's sync debug mode."""
    mode_before = syncs.mode()
    level_before = torch.cuda.get_sync_debug_mode()
    try:
        yield
    finally:
        syncs.disable()
        syncs.reset()
        syncs.set_mode(mode_before)
    assert torch.cuda.get_sync_debug_mode() == level_before

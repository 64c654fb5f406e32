"""What the call-form tests share: the seed, and cc installed alone or together with the detector.

Used by ``tests/unit/syncs/test_syncs_signatures.py``,
``tests/unit/cc/test_cc_signatures.py`` and their GPU counterparts under
``tests/gpu``; the grid of call forms itself is ``tests/unit/syncs/signature_grid.py``.
A test module takes the fixture by importing it (``from support.call_forms import seed``).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import syncless.cc as cc


@pytest.fixture
def seed() -> int:
    """A fresh seed for the call forms' random tensors, printed so that a failure can be rerun."""
    value = random.randrange(2**31)
    print(f"signature grid seed: {value}")
    return value


def cc_patched_attributes() -> list[tuple[object, str]]:
    """(owner, name) of every attribute cc may patch."""
    from syncless.cc import _sync_patches

    pairs = [(torch.Tensor, name) for name in ("to", "cuda", "copy_", "cpu", "item", "tolist")]
    return pairs + [(owner, name) for owner, name, _ in _sync_patches.patch_targets()]


@contextlib.contextmanager
def cc_installed(mode: str) -> Iterator[None]:
    """cc installed in ``mode`` (it must install), uninstalled after."""
    assert cc.install(mode), f"cc must install in mode {mode!r}"
    try:
        yield
    finally:
        cc.uninstall()


@contextlib.contextmanager
def cc_with_syncs(mode: str, syncs_on: Callable[[], Any], syncs_first: bool) -> Iterator[None]:
    """cc in ``mode`` and the detector (``syncs_on()``, a context manager), the one named first entered first."""
    cc_on = lambda: cc_installed(mode)  # noqa: E731 - a factory, as syncs_on is
    first, second = (syncs_on, cc_on) if syncs_first else (cc_on, syncs_on)
    with first(), second():
        yield


def cc_configurations(syncs_on: Callable[[], Any], labels: list[str] | None = None) -> dict[str, Callable[[], Any]]:
    """Label -> a context-manager factory: cc alone, or with ``syncs_on()`` in either order.

    ``labels`` picks some, in that order (default: all six). A label names
    ``syncs`` exactly when the detector is on.
    """
    every = {
        "cc on": lambda: cc_installed("on"),
        "cc emulate": lambda: cc_installed("emulate"),
        "syncs, then cc on": lambda: cc_with_syncs("on", syncs_on, True),
        "cc on, then syncs": lambda: cc_with_syncs("on", syncs_on, False),
        "syncs, then cc emulate": lambda: cc_with_syncs("emulate", syncs_on, True),
        "cc emulate, then syncs": lambda: cc_with_syncs("emulate", syncs_on, False),
    }
    return every if labels is None else {label: every[label] for label in labels}

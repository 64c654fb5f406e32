"""CPU tests of syncless.cc: pretend torch sees a GPU, so ``install()`` patches and the layering can be tested.

``install()`` patches nothing on a torch without CUDA (tests/unit/cc/test_cc_install_cpu.py checks that by
undoing this fixture); everything else here runs the patched code on CPU tensors.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _pretend_cuda_is_available(monkeypatch):
    import syncless.cc as cc

    monkeypatch.setattr(cc, "_cuda_available", lambda: True)


@pytest.fixture(autouse=True)
def _no_failure_count_left_behind():
    """A test's own queues keep their failures counted in ``UNRAISED`` (a D2H stream's are dropped by
    ``close_d2h_stream``/``uninstall``); the count must not reach the next test, where a kept failure makes the
    wrappers take their covering paths."""
    yield
    from syncless.cc import _worker

    _worker.UNRAISED[0] = 0

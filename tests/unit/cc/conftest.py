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

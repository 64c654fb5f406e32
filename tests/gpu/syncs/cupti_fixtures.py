"""GPU fixtures for the CUPTI backend: cupti-python present (or a clear skip/failure), state restored.

A test needing CUPTI skips when cupti-python is not installed, unless both
``SYNCLESS_REQUIRE_GPU=1`` and ``SYNCLESS_REQUIRE_CUPTI=1`` are set, then it
fails: the lead can run every other GPU test without cupti-python.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from syncless import syncs
from syncless._core import config
from syncless.syncs import _backend


def require_cupti() -> None:
    """Skip (or fail, under SYNCLESS_REQUIRE_GPU=1 SYNCLESS_REQUIRE_CUPTI=1) without cupti-python."""
    if importlib.util.find_spec("cupti") is not None:
        return
    reason = "cupti-python is not installed (pip install 'syncless[cupti]')"
    if config.read("SYNCLESS_REQUIRE_GPU") and config.read("SYNCLESS_REQUIRE_CUPTI"):
        pytest.fail(f"{reason}, and SYNCLESS_REQUIRE_CUPTI=1 forbids skipping", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def cupti_detector(cuda_device):
    """The detector in record mode with the CUPTI backend on the real GPU; everything put back after."""
    import torch

    require_cupti()
    mode_before, backend_before = syncs.mode(), _backend.backend.requested
    was_enabled = syncs.is_enabled()
    if was_enabled:
        syncs.disable()
    syncs.set_mode("record")
    syncs.set_backend("cupti")
    syncs.reset()
    torch.cuda.synchronize()
    assert syncs.enable(), "the detector must be active on a GPU machine"
    try:
        yield
        # After the test's regions: it was CUPTI that checked; it is held until disable(), which lets it go.
        assert syncs.backend_choice().active == "cupti", syncs.backend_choice()
        syncs.disable()
        assert _backend.backend.subscriber is None
    finally:
        syncs.disable()
        syncs.reset()
        syncs.set_backend(backend_before)
        syncs.set_mode(mode_before)


def rows_at(report, filename: str, line: int):
    """The report's rows at ``filename``:``line`` (``filename`` a basename)."""
    return [s for s in report.sites if os.path.basename(s.first.filename) == filename and s.first.lineno == line]

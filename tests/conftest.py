"""Test harness: GPU markers that skip without hardware, or fail under SYNCLESS_REQUIRE_GPU=1."""

from __future__ import annotations

import pytest

from syncless._core import config
from syncless._core.hardware import cuda_device_count, gpu_gate

pytest_plugins = ["pytester"]


def _gpus_needed(item: pytest.Item) -> int:
    multi = item.get_closest_marker("multi_gpu")
    if multi is not None:
        return int(multi.kwargs.get("count", 2))
    if item.get_closest_marker("gpu") is not None:
        return 1
    return 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    needed = _gpus_needed(item)
    if needed == 0:
        return
    action, reason = gpu_gate(needed, cuda_device_count(), config.read("SYNCLESS_REQUIRE_GPU"))
    if action == "fail":
        pytest.fail(reason, pytrace=False)
    if action == "skip":
        pytest.skip(reason)


@pytest.fixture
def cuda_device():
    """The first CUDA device (use with the ``gpu`` marker)."""
    import torch

    return torch.device("cuda", 0)

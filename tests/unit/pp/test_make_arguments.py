"""``make_transport`` refuses bad arguments with a ValueError that says which one, on CPU ranks over gloo."""

from __future__ import annotations

import math

import pytest
import torch

from support.ranks import run_ranks
from syncless.pp import make_transport

pytestmark = pytest.mark.timeout(120)

BAD_TIMEOUTS = [0, -1.0, math.inf, math.nan, True, 1e-300, 0.09, 86401, 1e300]  # True is an int to Python


def _refusal(**kwargs):
    """Return the ValueError ``make_transport`` raises on this rank for ``kwargs``; fail if it builds one."""
    rank = torch.distributed.get_rank()
    persistent = None if rank == 0 else {"hidden": torch.full((4, 8), float("nan"))}
    try:
        make_transport(None, persistent, **{"backend": "torch_distributed", "device": "cpu", **kwargs})
    except ValueError as err:
        return str(err)
    raise AssertionError(f"make_transport accepted {kwargs}")


def bad_arguments(rank, world_size):
    """Every refusal this rank saw, in a fixed order: backend, each bad timeout, then the device."""
    messages = [_refusal(backend="bogus")]
    messages += [_refusal(timeout_s=timeout_s) for timeout_s in BAD_TIMEOUTS]
    # The last stage's persistent tensors are on the CPU; it says its device is a GPU.
    messages.append(_refusal(device="cuda:0" if rank == world_size - 1 else "cpu"))
    return messages


def test_bad_backend_timeout_or_device_raise_value_errors_naming_them():
    results = run_ranks(bad_arguments, 2, backend="gloo", timeout_s=60)
    backend, *timeouts, device = results[0]
    assert "backend must be one of auto, copy_engine, torch_distributed" in backend and "'bogus'" in backend
    assert len(timeouts) == len(BAD_TIMEOUTS)
    for message, timeout_s in zip(timeouts, BAD_TIMEOUTS):
        if timeout_s is True:
            assert message == "timeout_s must be a number of seconds; got True"
        else:
            assert message == (f"timeout_s={timeout_s!r} is out of bounds: a pipeline timeout is 0.1 to 86400 "
                               "seconds (one day)")
    assert "stage 1 (rank 1)" in device and "device=cuda:0 but the persistent tensors are on cpu" in device
    assert results[1] == results[0]  # the device refusal, found on stage 1, is raised on stage 0 too

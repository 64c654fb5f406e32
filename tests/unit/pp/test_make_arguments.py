"""``make_transport`` refuses bad arguments with a ValueError that says which one, on CPU ranks over gloo."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch

from support.ranks import run_ranks
from syncless.pp import make_transport

_spec = importlib.util.spec_from_file_location("pp_cases", pathlib.Path(__file__).with_name("pp_cases.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

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


def test_stages_passing_different_arguments_or_a_malformed_persistent_fail_alike_and_a_rebuild_works():
    results = run_ranks(cases.mismatched_arguments, 2, backend="gloo", timeout_s=90)
    assert results[0] == results[1]  # the same message on both stages, each raised within 3 s
    assert len(results[0]) == 9
    assert all("stage 1 (rank 1)" in message for message in results[0][5:])  # the stage that passed it

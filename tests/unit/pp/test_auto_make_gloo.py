"""``make_transport(depth="auto")`` on CPU ranks over gloo: accepted, checked alike on every stage, or refused."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch
import torch.distributed as dist

from support.ranks import run_ranks
from syncless.pp import make_transport

_spec = importlib.util.spec_from_file_location("pp_cases", pathlib.Path(__file__).with_name("pp_cases.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.timeout(120)

BAD_DEPTHS = ["Auto", " auto", -1, 1.5, True, None]


def _persistent(rank):
    return None if rank == 0 else {"hidden": torch.full((4, 8), float("nan"))}


def _refusal(**kwargs):
    try:
        make_transport(None, _persistent(dist.get_rank()), **{"backend": "torch_distributed", "device": "cpu",
                                                              **kwargs})
    except ValueError as err:
        return str(err)
    raise AssertionError(f"make_transport accepted {kwargs}")


def auto_arguments(rank, world_size):
    """Every refusal this rank saw, then whether depth="auto" works over torch.distributed and the auto backend."""
    messages = [_refusal(depth=bad) for bad in BAD_DEPTHS]
    messages.append(_refusal(depth="auto" if rank == 0 else 2))  # stages disagree
    os.environ["SYNCLESS_PP_AUTO_SLOTS"] = str(2 + rank)  # stages disagree on the slot count
    messages.append(_refusal(depth="auto"))
    os.environ["SYNCLESS_PP_AUTO_SLOTS"] = "1" if rank == 1 else "2"  # below the floor on stage 1
    messages.append(_refusal(depth="auto"))
    del os.environ["SYNCLESS_PP_AUTO_SLOTS"]
    # Accepted: with torch.distributed (which ignores it), and with backend="auto", which falls back here.
    delivered = []
    for backend in ("torch_distributed", None):
        persistent = cases._persistent(torch.device("cpu"), 8) if rank == 1 else None
        transport = make_transport(None, persistent, backend=backend, device="cpu", depth="auto")
        for step in range(1, 6):
            if rank == 0:
                transport.send(cases.expected(77, step, 8, torch.device("cpu")))
            else:
                delivered.append(int(cases._mismatches(transport.recv(), cases.expected(77, step, 8,
                                                                                        torch.device("cpu")))))
        dist.barrier()
        delivered.append((transport.backend, transport.fallback_reason is not None))
        transport.close()
    return messages, delivered


def test_depth_auto_is_accepted_exactly_and_checked_alike_on_every_stage():
    results = run_ranks(auto_arguments, 2, backend="gloo", timeout_s=90)
    messages, delivered = results[0]
    assert results[1][0] == messages  # every refusal is raised on every stage alike
    *bad, disagree, slots_differ, slots_low = messages
    for message, value in zip(bad, BAD_DEPTHS):
        assert 'depth must be an int >= 0 (steps in flight per link) or "auto"' in message, message
        assert f"got {value!r}" in message, message
    assert 'got \'Auto\' (str): the only word it accepts is "auto", lower-case' in bad[0]
    assert "every stage must pass the same depth" in disagree and "'auto'" in disagree and ": 2" in disagree
    assert "SYNCLESS_PP_AUTO_SLOTS" in slots_differ and "stage 0 (rank 0): 2, stage 1 (rank 1): 3" in slots_differ
    assert "SYNCLESS_PP_AUTO_SLOTS='1' is not valid" in slots_low and "stage 1 (rank 1)" in slots_low
    assert results[1][1] == [0] * 5 + [("torch_distributed", False)] + [0] * 5 + [("torch_distributed", True)]

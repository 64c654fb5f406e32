"""``make_transport(..., depth="auto")`` between two processes on one GPU (CUDA IPC on one device).

The bit-exact and stream-switching rows of ``depth="auto"`` are in ``test_copy_engine_one_gpu.py``
beside the fixed depths. Each test spawns ranks on cuda:0 over gloo, with a hard timeout, printing
progress (run with -s to watch it).
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from support.ranks import run_ranks

_spec = importlib.util.spec_from_file_location(
    "pp_auto_cases", pathlib.Path(__file__).parents[2] / "unit" / "pp" / "pp_auto_cases.py"
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(200)]


def test_a_symmetric_exchange_finishes_bit_exact_under_auto():
    # Both ranks send step N before they receive step N, on one stream: a rendezvous (depth=0) would wait
    # for the 20 s timeout; auto must finish.
    results = run_ranks(cases.symmetric_exchange, 2, args=(400,), devices=[0, 0], timeout_s=150)
    for result in results:
        assert result["mismatches"] == 0 and result["steps"] == 400, result
        assert result["leaked_nbytes"] == 0, result


def test_persistent_tensors_that_cannot_be_shared_run_slot_only_with_the_reason():
    results = run_ranks(cases.not_shareable, 2, devices=[0, 0], timeout_s=120)
    for rank, result in enumerate(results):
        assert result["depth"] == "auto" and result["slots"] == 2, result
        reason = result["reason"]
        assert reason is not None and "steps into stage 1 (rank 1) all go through a slot" in reason, (rank, reason)
        assert 'depth="auto"' in reason and "alloc_persistent" in reason, reason
        assert result["leaked_nbytes"] == 0, result
    assert results[0]["direct_steps"] == 0
    assert results[1]["mismatches"] == 0

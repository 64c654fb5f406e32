"""Both pipeline transports between two GPUs over NVLink (and a third stage sharing a GPU).

Each test spawns ranks with a hard timeout, printing progress (run with -s to watch it).
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from support.ranks import run_ranks

_spec = importlib.util.spec_from_file_location(
    "pp_cases", pathlib.Path(__file__).parents[2] / "unit" / "pp" / "pp_cases.py"
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = [pytest.mark.multi_gpu(count=2), pytest.mark.timeout(200)]


def test_copy_engine_two_gpus_2000_steps_bit_exact():
    # Default depth; every 100th step the receiver stalls ~20 ms, so the sender fills the ring and must wait.
    results = run_ranks(
        cases.bit_exact, 2, args=("cuda", 2000, 256, "copy_engine", "copy_engine", None, 1234, 60, None, 100),
        devices=[0, 1], timeout_s=150,
    )
    assert results[1] == {"backend": "copy_engine", "mismatches": 0, "steps": 2000}
    assert results[0]["batched_copies"] == results[0]["batching_expected"]  # whenever driver and bindings can


@pytest.mark.parametrize("stage_ranks", [None, [1, 0]])
def test_copy_engine_two_gpus_auto_2000_steps_bit_exact(stage_ranks):
    # depth="auto" (opt-in): paced hosts (pp_cases.auto_host_pause) so that steps go both ways, direct into
    # the persistent tensors and through a slot; every 100th step the receiver stalls ~20 ms.
    results = run_ranks(
        cases.bit_exact, 2, args=("cuda", 2000, 256, "copy_engine", "copy_engine", stage_ranks, 2026, 60, "auto", 100),
        devices=[0, 1], timeout_s=150,
    )
    first, last = (0, 1) if stage_ranks is None else (1, 0)
    assert results[last] == {"backend": "copy_engine", "mismatches": 0, "steps": 2000}
    assert 0 < results[first]["direct_steps"] < 2000, results[first]


def test_three_stages_on_two_gpus_auto_middle_stage_forwards_bit_exact():
    results = run_ranks(
        cases.bit_exact, 3, args=("cuda", 500, 64, "copy_engine", "copy_engine", None, 31, 60, "auto"),
        devices=[0, 1, 1], timeout_s=120,
    )
    assert [r["mismatches"] for r in results] == [0, 0, 0]


def test_copy_engine_reverse_direction_depth_1():
    results = run_ranks(
        cases.bit_exact, 2, args=("cuda", 300, 64, "copy_engine", "copy_engine", [1, 0], 99, 60, 1, 50),
        devices=[0, 1], timeout_s=90,
    )
    assert results[0]["mismatches"] == 0


def test_copy_engine_depth_4_with_stalls():
    results = run_ranks(
        cases.bit_exact, 2, args=("cuda", 600, 64, "copy_engine", "copy_engine", None, 4321, 60, 4, 30),
        devices=[0, 1], timeout_s=90,
    )
    assert results[1]["mismatches"] == 0


def test_copy_engine_depth_0_straight_into_persistent_with_stalls():
    results = run_ranks(
        cases.bit_exact, 2, args=("cuda", 600, 64, "copy_engine", "copy_engine", None, 777, 60, 0, 30),
        devices=[0, 1], timeout_s=90,
    )
    assert results[1]["mismatches"] == 0


@pytest.mark.parametrize("depth", [0, 2, "auto"])
def test_copy_engine_two_gpus_steps_stay_in_order_across_streams(depth):
    # Calls alternate at random between torch's default stream and created streams, some held by a
    # long kernel first (depth >= 1 sends through the relay stream from any of them, depth 0 from none).
    results = run_ranks(cases.stream_switching, 2, args=(400, depth), devices=[0, 1], timeout_s=120)
    assert results[1] == {"mismatches": 0, "steps": 400}


def test_three_stages_on_two_gpus_middle_stage_forwards_bit_exact():
    results = run_ranks(
        cases.bit_exact, 3, args=("cuda", 500, 64, "copy_engine", "copy_engine"), devices=[0, 1, 1], timeout_s=120
    )
    assert [r["mismatches"] for r in results] == [0, 0, 0]


def test_torch_distributed_nccl_2000_steps_bit_exact():
    results = run_ranks(
        cases.bit_exact, 2, args=("cuda", 2000, 256, "torch_distributed", "torch_distributed"), backend="nccl",
        devices=[0, 1], timeout_s=150,
    )
    assert results[1] == {"backend": "torch_distributed", "mismatches": 0, "steps": 2000}


def test_tensor_on_the_wrong_gpu_is_refused():
    messages = run_ranks(cases.validation, 2, args=("cuda", "copy_engine", 1), devices=[0, 1], timeout_s=90)[0]
    assert len(messages) == 8
    assert any("expected a tensor on cuda:0, got one on cuda:1" in m for m in messages)


def test_uniform_failure_across_two_gpus():
    messages = run_ranks(
        cases.uniform_failure, 2, args=("cuda", 1, "peer_open", 65536), devices=[0, 1], timeout_s=120
    )
    assert messages[0] == messages[1] and "stage 1 (rank 1)" in messages[0]


def test_doctor_choice_is_copy_engine_over_nvlink():
    from syncless.pp import describe_local_choice

    result = describe_local_choice()
    assert result["transport"] == "copy_engine", result
    assert any(c["name"] == "NVLink 0<->1" and c["ok"] for c in result["checks"]), result
    from syncless.pp import _driver

    expected = "yes" if _driver.batch_api_problem() is None else "no"
    assert result["batched_copies"].startswith(expected), result

"""The copy-engine transport between processes that share one GPU (CUDA IPC on one device).

Each test spawns ranks on cuda:0 over gloo, with a hard timeout, printing progress
(run with -s to watch it).
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

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(200)]


@pytest.mark.parametrize("depth, steps", [(0, 800), (1, 800), (2, 2000), (3, 800), ("auto", 2000)])
def test_two_stages_on_one_gpu_deliver_every_step_bit_exact(depth, steps):
    # Every 100th step the receiver stalls ~20 ms: the sender fills all `depth` slots and must wait.
    # With "auto" the hosts are paced (pp_cases.auto_host_pause) so that both paths are taken.
    seed = 1234 + (depth if isinstance(depth, int) else 99)
    results = run_ranks(
        cases.bit_exact, 2, args=("cuda", steps, 256, "copy_engine", "copy_engine", None, seed, 60, depth, 100),
        devices=[0, 0], timeout_s=150,
    )
    assert results[1] == {"backend": "copy_engine", "mismatches": 0, "steps": steps}
    assert results[0]["batched_copies"] == results[0]["batching_expected"]  # whenever driver and bindings can
    if depth == "auto":
        assert 0 < results[0]["direct_steps"] < steps, results[0]


@pytest.mark.parametrize("depth", [0, 2, "auto"])
def test_steps_stay_in_order_when_each_call_runs_on_another_stream(depth):
    results = run_ranks(cases.stream_switching, 2, args=(400, depth), devices=[0, 0], timeout_s=150)
    assert results[1] == {"mismatches": 0, "steps": 400}
    if depth == "auto":  # both paths, so a direct step on the caller's stream follows a relayed one and back
        assert 0 < results[0]["direct_steps"] < 400, results[0]


def test_three_stages_on_one_gpu_middle_stage_forwards_bit_exact():
    results = run_ranks(
        cases.bit_exact, 3, args=("cuda", 400, 64, "copy_engine", "copy_engine", [1, 2, 0]), devices=[0, 0, 0],
        timeout_s=120,
    )
    assert [r["mismatches"] for r in results] == [0, 0, 0]


def test_auto_picks_copy_engines_here():
    results = run_ranks(cases.bit_exact, 2, args=("cuda", 50, 16, None, "copy_engine"), devices=[0, 0], timeout_s=90)
    assert results[1]["mismatches"] == 0


def test_bad_steps_raise_before_gpu_work_and_the_transport_keeps_working():
    messages = run_ranks(cases.validation, 2, args=("cuda", "copy_engine"), devices=[0, 0], timeout_s=90)[0]
    assert len(messages) == 7
    assert any("got one on cpu" in m for m in messages)


@pytest.mark.parametrize("inject_rank, inject", [(1, "mem_ops"), (0, "peer_open"), (1, "peer_open")])
def test_one_rank_failing_set_up_fails_every_rank_alike_and_frees_everything(inject_rank, inject):
    messages = run_ranks(
        cases.uniform_failure, 2, args=("cuda", inject_rank, inject, 65536), devices=[0, 0], timeout_s=120
    )
    assert messages[0] == messages[1]
    assert f"stage {inject_rank} (rank {inject_rank})" in messages[0] and "injected" in messages[0]


def test_dead_sender_makes_recv_raise_within_the_timeout():
    timeout_s = 5.0
    results = run_ranks(
        cases.peer_death, 2, args=("cuda", "copy_engine", timeout_s), devices=[0, 0], timeout_s=120, may_die={0}
    )
    assert results[0] is None
    assert results[1] < timeout_s + 10


def test_silent_sender_makes_recv_raise_after_the_timeout():
    timeout_s = 2.0
    results = run_ranks(
        cases.stopped_sending, 2, args=("cuda", "copy_engine", timeout_s), devices=[0, 0], timeout_s=90
    )
    assert timeout_s * 0.9 <= results[1] < timeout_s + 10


def test_gpu_wait_that_never_ends_is_released_and_reported():
    results = run_ranks(cases.gpu_stall, 2, args=(2.0,), devices=[0, 0], timeout_s=120)
    assert results[0] == {"sender_failure": None}
    receiver = results[1]
    assert "waited" in receiver["error"] and "timeout 2 s" in receiver["error"]
    assert receiver["ids_poisoned"], "the released step should read the 0xFF poison, not the late data"


@pytest.mark.parametrize("depth", [0, 2, "auto"])
def test_a_step_may_carry_any_subset_of_the_keys_bit_exact_on_one_gpu(depth):
    # Random subsets of the layout's keys (none and all included), conj/neg views every third step.
    results = run_ranks(cases.subset_steps, 2, args=("cuda", "copy_engine", depth, 300), devices=[0, 0], timeout_s=120)
    assert results[1]["backend"] == "copy_engine"
    assert results[1]["wrong"] == 0 and results[1]["steps"] == 300, results[1]
    assert results[1]["partial"] > 0 and results[1]["empty"] > 0, results[1]

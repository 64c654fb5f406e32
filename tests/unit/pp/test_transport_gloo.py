"""The pipeline transports between CPU processes over gloo (runs in CI, no GPU).

Every test spawns ranks with a hard timeout (support.ranks) that print progress.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from support.ranks import run_ranks

_spec = importlib.util.spec_from_file_location("pp_cases", pathlib.Path(__file__).with_name("pp_cases.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.timeout(120)


def test_two_stages_deliver_every_step_bit_exact():
    results = run_ranks(
        cases.bit_exact, 2, args=("cpu", 300, 24, None, "torch_distributed"), timeout_s=90
    )
    assert results[1] == {"backend": "torch_distributed", "mismatches": 0, "steps": 300}


def test_middle_stage_receives_checks_and_forwards():
    results = run_ranks(
        cases.bit_exact, 3, args=("cpu", 120, 12, "torch_distributed", "torch_distributed", [2, 0, 1]), timeout_s=90
    )
    assert [r["mismatches"] for r in results] == [0, 0, 0]


def test_bad_steps_raise_value_errors_and_the_transport_keeps_working():
    messages = run_ranks(cases.validation, 2, args=("cpu", "torch_distributed"), timeout_s=60)[0]
    assert len(messages) == 7
    assert any("'hidden'" in m and "torch.float32" in m for m in messages)


def test_copy_engine_on_cpu_fails_uniformly_and_auto_falls_back_once():
    messages = run_ranks(cases.uniform_failure, 2, args=("cpu", 1, None, 8), timeout_s=60)
    assert messages[0] == messages[1]
    assert "CUDA" in messages[0] and "stage 0 (rank 0)" in messages[0]


def test_dead_sender_makes_recv_raise_within_the_timeout():
    timeout_s = 3.0
    results = run_ranks(
        cases.peer_death, 2, args=("cpu", "torch_distributed", timeout_s), timeout_s=60, may_die={0}
    )
    assert results[0] is None  # the sender really died
    assert results[1] < timeout_s + 10


def test_silent_sender_makes_recv_raise_after_the_timeout():
    timeout_s = 1.5
    results = run_ranks(cases.stopped_sending, 2, args=("cpu", "torch_distributed", timeout_s), timeout_s=60)
    assert timeout_s * 0.9 <= results[1] < timeout_s + 10


def test_bad_or_mismatched_depth_fails_on_every_rank_alike():
    messages = run_ranks(cases.depth_checks, 2, args=("cpu",), timeout_s=60)
    assert messages[0] == messages[1] and len(messages[0]) == 4
    assert "same depth" in messages[0][3]


def test_send_buffers_do_not_pile_up():
    from syncless.pp._torch_dist import MAX_SENDS_IN_FLIGHT

    most_pending = run_ranks(cases.bounded_sends, 2, args=(200,), timeout_s=90)[0]
    assert most_pending <= MAX_SENDS_IN_FLIGHT


def test_a_fallback_reports_what_the_failed_copy_engine_set_up_kept():
    results = run_ranks(cases.fallback_after_a_leaky_set_up, 2, args=("cpu", 8), timeout_s=60)
    assert results == [{"backend": "torch_distributed", "leaked_nbytes": 2 << 20, "abort": 2 << 20}] * 2


def test_a_step_may_carry_any_subset_of_the_keys_and_conj_neg_views_arrive_as_values():
    # torch.distributed keeps `depth` but does not use it; the copy-engine depths are in
    # test_copy_engine_steps_cpu.py (simulated GPU) and tests/gpu/pp (one GPU).
    results = run_ranks(
        cases.subset_steps, 2, args=("cpu", "torch_distributed", 2, 60), timeout_s=60
    )
    assert results[1]["wrong"] == 0 and results[1]["steps"] == 60, results[1]
    assert results[1]["partial"] > 0 and results[1]["empty"] > 0, results[1]


def test_recv_wait_false_gives_the_keys_at_once_and_the_data_at_first_use():
    results = run_ranks(cases.deferred_recv, 2, args=("cpu", "torch_distributed", 2, 40), timeout_s=60)
    assert results[1] == {"backend": "torch_distributed", "checked": 30, "unused": 10}


def test_a_received_view_is_overwritten_by_the_next_step_as_the_docs_say():
    result = run_ranks(cases.views_are_overwritten, 2, timeout_s=60)[1]
    assert result == {"before": 1.0, "after": 2.0, "same_memory": True, "kept": 1.0}

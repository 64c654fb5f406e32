"""The pp benchmark's plan: payload sizes, rows, step counts and labels (CPU only)."""

import pytest

from syncless.bench._pp_plan import (
    DECODE_STEP_NBYTES,
    FULL_PAYLOADS,
    KIB,
    MIB,
    ROW_NBYTES,
    Plan,
    make_plan,
    payload_label,
    rows_for,
    size_label,
)


def test_rows_follow_two_bf16_tensors_8192_wide():
    assert ROW_NBYTES == 2 * 8192 * 2
    assert rows_for(8 * MIB) == 256  # the decode step of issue 4
    assert rows_for(256 * MIB) == 8192  # an 8k-token prefill
    assert rows_for(64 * KIB) == 2


@pytest.mark.parametrize("nbytes", [0, -ROW_NBYTES, ROW_NBYTES + 1, 1000])
def test_rows_reject_sizes_that_are_not_whole_rows(nbytes):
    with pytest.raises(ValueError, match=f"multiple of {ROW_NBYTES}.*got {nbytes}"):
        rows_for(nbytes)


def test_full_plan_covers_issue_4_payloads():
    plan = make_plan(quick=False)
    assert plan.payloads == FULL_PAYLOADS
    assert min(plan.payloads) == 64 * KIB and max(plan.payloads) == 256 * MIB
    assert DECODE_STEP_NBYTES in plan.payloads
    assert plan.latency_payloads == (64 * KIB, 1 * MIB, 8 * MIB)
    assert plan.max_rows == 8192 and plan.latency_max_rows == 256
    assert not plan.quick


def test_quick_plan_is_smaller_but_keeps_the_goal_sizes():
    full, quick = make_plan(quick=False), make_plan(quick=True)
    assert quick.quick
    assert set(quick.payloads) < set(full.payloads)
    assert 64 * MIB in quick.payloads and 8 * MIB in quick.payloads
    assert quick.hard_timeout_s < full.hard_timeout_s
    assert quick.max_rows == 2048
    assert quick.bandwidth_reps <= full.bandwidth_reps and quick.latency_reps <= full.latency_reps


def test_steps_are_bounded_both_ways():
    plan = make_plan(quick=False)
    assert plan.steps_for(64 * KIB) == plan.bandwidth_max_steps
    assert plan.steps_for(256 * MIB) == plan.bandwidth_min_steps
    middle = plan.steps_for(64 * MIB)
    assert plan.bandwidth_min_steps <= middle <= plan.bandwidth_max_steps
    assert middle == 32  # 2 GiB / 64 MiB


def test_plan_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="cpu_nbytes must be one of the payloads"):
        Plan(quick=True, payloads=(64 * KIB, 64 * MIB))
    with pytest.raises(ValueError, match="interference_nbytes must be at most"):
        Plan(quick=True, payloads=(64 * KIB, 8 * MIB), interference_nbytes=64 * MIB)
    with pytest.raises(ValueError, match="multiple of"):
        Plan(quick=True, payloads=(8 * MIB, 12345))


def test_labels():
    assert size_label(64 * KIB) == "64 KiB"
    assert size_label(256 * MIB) == "256 MiB"
    assert size_label(100) == "100 B"
    assert payload_label(8 * MIB) == "8 MiB (decode, 256 tokens)"
    assert payload_label(256 * MIB) == "256 MiB (prefill, 8192 tokens)"
    assert payload_label(1 * MIB) == "1 MiB (32 tokens)"


def test_plan_survives_pickling_for_spawned_workers():
    import pickle

    plan = make_plan(quick=True)
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert plan.as_dict()["payloads"] == plan.payloads


def test_prefill_label_starts_at_4096_tokens():
    assert payload_label(128 * MIB) == "128 MiB (prefill, 4096 tokens)"
    assert payload_label(64 * MIB) == "64 MiB (2048 tokens)"


def test_steps_round_up_to_move_at_least_the_target_bytes():
    plan = Plan(quick=True, payloads=(64 * KIB, 8 * MIB), interference_nbytes=8 * MIB,
                bandwidth_target_nbytes=100 * MIB, bandwidth_min_steps=1)
    assert plan.steps_for(8 * MIB) == 13  # 12.5 steps of 8 MiB make 100 MiB


def test_largest_payload_counts_the_pending_receive_and_the_latency_sizes():
    small = dict(quick=True, payloads=(64 * KIB, 1 * MIB), cpu_nbytes=1 * MIB, interference_nbytes=1 * MIB)
    pending = Plan(**small, latency_payloads=(64 * KIB,), pending_nbytes=8 * MIB)
    assert pending.max_nbytes == 8 * MIB and pending.max_rows == 256
    latency = Plan(**small, latency_payloads=(64 * KIB, 16 * MIB), pending_nbytes=64 * KIB)
    assert latency.max_nbytes == 16 * MIB and latency.latency_max_rows == 512


def test_interference_payload_may_not_outgrow_the_buffers():
    with pytest.raises(ValueError, match=f"at most the largest payload {8 * MIB}; got {16 * MIB}"):
        Plan(quick=True, payloads=(64 * KIB, 8 * MIB), interference_nbytes=16 * MIB)
    assert Plan(quick=True, payloads=(64 * KIB, 8 * MIB), interference_nbytes=8 * MIB).interference_nbytes == 8 * MIB

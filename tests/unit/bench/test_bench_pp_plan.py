"""The pp benchmark's plan: payload sizes, rows, step counts and labels (CPU only)."""

import pytest

from syncless.bench._pp_plan import (
    DECODE_STEP_NBYTES,
    FULL_PAYLOADS,
    GOAL_SPLIT_NBYTES,
    KIB,
    MIB,
    ROW_NBYTES,
    Plan,
    latency_vs_nccl_target,
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


def test_full_plan_covers_issue_18_sizes():
    plan = make_plan(quick=False)
    assert plan.payloads == FULL_PAYLOADS
    assert min(plan.payloads) == 64 * KIB and max(plan.payloads) == 256 * MIB
    assert DECODE_STEP_NBYTES in plan.payloads
    # issue 18's latency table: every size from 64 KiB to 256 MiB
    assert plan.latency_payloads == (64 * KIB, 1 * MIB, 8 * MIB, 64 * MIB, 256 * MIB)
    assert set(plan.latency_payloads) <= set(plan.payloads)  # bandwidth at every latency size too
    assert plan.max_rows == 8192 and plan.latency_max_rows == 8192  # the echo transports carry 256 MiB
    assert not plan.quick


def test_quick_plan_is_smaller_but_keeps_the_goal_sizes():
    full, quick = make_plan(quick=False), make_plan(quick=True)
    assert quick.quick
    assert set(quick.payloads) < set(full.payloads)
    assert 64 * MIB in quick.payloads and 8 * MIB in quick.payloads
    assert quick.hard_timeout_s < full.hard_timeout_s
    assert quick.max_rows == 2048
    assert quick.bandwidth_reps <= full.bandwidth_reps and quick.latency_reps <= full.latency_reps
    # latency on both sides of the 1 MiB split of the goals, fewer sizes than the full run
    assert set(quick.latency_payloads) < set(full.latency_payloads)
    assert min(quick.latency_payloads) < GOAL_SPLIT_NBYTES <= max(quick.latency_payloads)
    assert quick.latency_max_rows == 256


def test_latency_round_trips_per_repeat_shrink_at_large_sizes():
    plan = make_plan(quick=False)
    assert [plan.latency_iters_for(n) for n in plan.latency_payloads] == [40, 40, 40, 32, 8]
    for nbytes in plan.latency_payloads:  # a repeat moves at most 2 GiB each way, or the fewest round trips
        iters = plan.latency_iters_for(nbytes)
        assert plan.latency_min_iters <= iters <= plan.latency_iters
        assert iters * nbytes <= plan.latency_target_nbytes or iters == plan.latency_min_iters
    quick = make_plan(quick=True)
    assert [quick.latency_iters_for(n) for n in quick.latency_payloads] == [20, 20, 20]
    assert Plan(quick=True, payloads=(64 * KIB, 8 * MIB), latency_payloads=(64 * KIB,), interference_nbytes=8 * MIB,
                latency_min_iters=3, latency_target_nbytes=16 * MIB).latency_iters_for(8 * MIB) == 3


def test_latency_targets_split_at_1_mib():
    assert GOAL_SPLIT_NBYTES == 1 * MIB
    assert latency_vs_nccl_target(64 * KIB) == 1.0
    assert latency_vs_nccl_target(1 * MIB - ROW_NBYTES) == 1.0
    assert latency_vs_nccl_target(1 * MIB) == 0.8
    assert latency_vs_nccl_target(256 * MIB) == 0.8


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
        Plan(quick=True, payloads=(64 * KIB, 8 * MIB), latency_payloads=(64 * KIB,), interference_nbytes=64 * MIB)
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
    small = dict(quick=True, payloads=(64 * KIB, 8 * MIB), latency_payloads=(64 * KIB, 1 * MIB))
    with pytest.raises(ValueError, match=f"at most the largest payload {8 * MIB}; got {16 * MIB}"):
        Plan(**small, interference_nbytes=16 * MIB)
    assert Plan(**small, interference_nbytes=8 * MIB).interference_nbytes == 8 * MIB

"""run_ranks: results in rank order, a failing rank's traceback, a hung rank killed at the deadline."""

import time

import pytest
import torch
import torch.distributed as dist

from syncless._core.launch import RankFailed, run_ranks


def _sum_ranks(rank, world_size, offset):
    value = torch.tensor([rank + offset], dtype=torch.float64)
    dist.all_reduce(value)
    return rank, float(value.item())


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(60)
    return rank


def test_results_in_rank_order():
    assert run_ranks(_sum_ranks, 2, args=(10,), timeout_s=60) == [(0, 21.0), (1, 21.0)]


def test_failing_rank_reports_its_traceback():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed.*ValueError: rank one refuses"):
        run_ranks(_fail_on_rank_one, 2, timeout_s=60)


def test_hung_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"ranks \[0\] gave no result within 8 s"):
        run_ranks(_hang_on_rank_zero, 2, timeout_s=8)
    assert time.monotonic() - start < 40

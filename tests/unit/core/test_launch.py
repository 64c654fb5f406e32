"""run_ranks: results in rank order, a failing rank's traceback, a hung rank killed at the deadline."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from syncless._core.launch import RankFailed, RanksTimedOut, run_ranks


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
    # The deadline leaves rank 1 room to start (a CUDA build of torch imports in seconds on a loaded host).
    with pytest.raises(RankFailed, match=r"ranks \[0\] gave no result within 20 s"):
        run_ranks(_hang_on_rank_zero, 2, timeout_s=20)
    assert time.monotonic() - start < 35  # the deadline, plus start-up and the kill


def _exit_on_rank_one(rank, world_size, code):
    if rank == 1:
        os._exit(code)
    return rank


def test_rank_that_dies_is_reported_with_its_exit_code():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed:\nexited with code 3 without a result"):
        run_ranks(_exit_on_rank_one, 2, args=(3,), timeout_s=60)


def test_rank_allowed_to_die_gives_none():
    assert run_ranks(_exit_on_rank_one, 2, args=(0,), timeout_s=60, may_die={1}) == [0, None]


def test_hung_rank_raises_ranks_timed_out():
    with pytest.raises(RanksTimedOut):
        run_ranks(_hang_on_rank_zero, 2, timeout_s=5)


def test_load_by_file_and_file_rendezvous():
    # This module is loaded again in each rank from its file (as for test modules without an importable name).
    assert run_ranks(_sum_ranks, 2, args=(1,), init="file", load_by_file=True, timeout_s=60) == [(0, 3.0), (1, 3.0)]


def test_unknown_rendezvous_is_refused():
    with pytest.raises(ValueError, match="init must be 'tcp' or 'file'"):
        run_ranks(_sum_ranks, 2, init="udp")


def _unpicklable_result(rank, world_size):
    return lambda: rank


def test_a_result_that_cannot_travel_is_that_ranks_error():
    with pytest.raises(RankFailed, match=r"(?s)rank [01] failed:.*pickle"):
        run_ranks(_unpicklable_result, 2, timeout_s=60)


def _fail_fast_on_rank_one_while_rank_zero_hangs(rank, world_size):
    if rank == 1:
        raise ValueError("rank one gives up")
    time.sleep(60)
    return rank


def _exit_on_rank_one_while_rank_zero_hangs(rank, world_size):
    if rank == 1:
        os._exit(5)
    time.sleep(60)
    return rank


@pytest.mark.parametrize(("body", "story"), [
    (_fail_fast_on_rank_one_while_rank_zero_hangs, "ValueError: rank one gives up"),
    (_exit_on_rank_one_while_rank_zero_hangs, "exited with code 5 without a result"),
])
def test_one_failed_rank_stops_the_run_without_waiting_for_the_others(body, story):
    start = time.monotonic()
    with pytest.raises(RankFailed, match=rf"(?s)rank 1 failed:.*{story}.*ranks \[0\] were stopped"):
        run_ranks(body, 2, timeout_s=60)
    assert time.monotonic() - start < 20  # not the 60 s rank 0 would sleep, nor the deadline


_SLOW_IMPORT_MODULE = '''
import os
import time

if os.environ.get("SLOW_IMPORT_IN_RANKS"):  # set by the parent after its own import: only the ranks sleep
    time.sleep(4)  # the rank is still unpickling its target (importing this module) when Ctrl-C comes


def work(rank, world_size):
    return rank
'''

_INTERRUPTED_PARENT = '''
import sys
sys.path.insert(0, sys.argv[1])
import os
import slow_import_target
from syncless._core.launch import run_ranks
os.environ["SLOW_IMPORT_IN_RANKS"] = "1"
try:
    run_ranks(slow_import_target.work, 2, timeout_s=60)
except KeyboardInterrupt:
    print("parent interrupted", flush=True)
'''


@pytest.mark.timeout(120)
def test_ctrl_c_while_ranks_still_import_their_target_prints_no_rank_traceback(tmp_path):
    # A terminal sends Ctrl-C to the whole process group. A rank still importing its target used to print a
    # KeyboardInterrupt traceback of its own (seen once in a CI-like run of the demo); ranks now start with
    # SIGINT ignored.
    import signal
    import subprocess
    import sys

    (tmp_path / "slow_import_target.py").write_text(_SLOW_IMPORT_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    parent = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_PARENT, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(2.5)  # the ranks are started and importing the slow module
    os.killpg(parent.pid, signal.SIGINT)
    out, err = parent.communicate(timeout=90)
    assert "parent interrupted" in out, (out, err)
    assert "Traceback" not in err, err

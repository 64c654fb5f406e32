"""The pp benchmark's parent side: result paths, message handling and stop decisions (CPU only)."""

import argparse
import socket

import pytest
import torch

from syncless._core.errors import MissingDependencyError
from syncless.bench._pp_launch import FINISHED, Collector, free_port, set_path


def make_collector(lines=None, hard=100.0, idle=10.0):
    sink = [] if lines is None else lines
    return Collector(sink.append, hard_timeout_s=hard, idle_timeout_s=idle, start_s=0.0), sink


def test_set_path_nests_and_merges_dicts():
    tree = {}
    set_path(tree, ("bandwidth", "raw", 65536), {"gbps": 18.0})
    set_path(tree, ("bandwidth", "raw", 65536), {"data_ok": True})  # the other rank's half
    set_path(tree, ("gemm",), {"alone": 1})
    set_path(tree, ("gemm",), 5)  # a non-dict replaces
    assert tree == {"bandwidth": {"raw": {65536: {"gbps": 18.0, "data_ok": True}}}, "gemm": 5}


def test_set_path_rejects_bad_paths():
    with pytest.raises(ValueError, match="empty path"):
        set_path({}, (), 1)
    tree = {"a": 3}
    with pytest.raises(ValueError, match="passes through 'a', which holds a int"):
        set_path(tree, ("a", "b"), 1)


def test_messages_fill_the_outcome_and_relay_progress():
    collector, lines = make_collector()
    collector.handle(("progress", 0, "measuring bandwidth"), 1.0)
    collector.handle(("result", 1, ("bandwidth", "ours", 8), {"gbps": 3.0}), 1.5)
    collector.handle(("note", 1, "no NVRTC"), 2.0)
    assert lines == ["rank 0: measuring bandwidth", "rank 1: note: no NVRTC"]
    outcome = collector.outcome
    assert outcome.results == {"bandwidth": {"ours": {8: {"gbps": 3.0}}}}
    assert outcome.notes == ["no NVRTC"]
    with pytest.raises(ValueError, match="unknown worker message kind 'bogus'"):
        collector.handle(("bogus", 0), 3.0)


def test_finished_only_when_both_ranks_are_done():
    collector, _ = make_collector()
    assert collector.verdict(1.0, [None, None]) is None
    collector.handle(("done", 0), 1.0)
    assert collector.verdict(1.0, [0, None]) is None  # rank 0 done and exited cleanly: keep waiting
    collector.handle(("done", 1), 2.0)
    assert collector.verdict(2.0, [0, None]) == FINISHED
    outcome = collector.finish(FINISHED)
    assert outcome.complete and outcome.failure is None


def test_an_error_stops_the_run_and_names_the_rank():
    collector, lines = make_collector()
    collector.handle(("error", 1, "Traceback (most recent call last):\n  ...\nTimeoutError: stuck flag\n"), 1.0)
    verdict = collector.verdict(1.0, [None, None])
    assert verdict == "rank 1 failed: TimeoutError: stuck flag"
    assert lines[0].startswith("rank 1 failed:\nTraceback")
    outcome = collector.finish(verdict)
    assert not outcome.complete and outcome.failure == verdict and 1 in outcome.errors


def test_a_rank_that_exits_without_finishing_stops_the_run():
    collector, _ = make_collector()
    collector.handle(("progress", 1, "measuring GEMM"), 1.0)
    verdict = collector.verdict(1.0, [None, -9])
    assert verdict.startswith("rank 1 exited with status -9 before finishing")
    assert "rank 1 last said 'measuring GEMM'" in verdict


def test_time_limits():
    collector, _ = make_collector(hard=100.0, idle=10.0)
    collector.handle(("progress", 0, "a"), 5.0)
    assert collector.verdict(14.9, [None, None]) is None
    assert collector.verdict(15.1, [None, None]).startswith("no message from either worker for 10 s")
    collector.handle(("progress", 0, "b"), 99.0)
    assert collector.verdict(100.5, [None, None]).startswith("hard time limit of 100 s reached")


def test_free_port_can_be_bound():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="checks the message without 2 GPUs"
)
def test_bench_pp_needs_two_gpus():
    from syncless.bench import _pp

    with pytest.raises(MissingDependencyError, match="needs 2 CUDA GPUs of one node.*found [01]"):
        _pp.run(argparse.Namespace(out=None, quick=True), lambda message: None)

"""Counters."""

import threading

import pytest

from syncless.cc._stats import CopyStats, StatsCounter


def test_counts_and_reset():
    c = StatsCounter()
    c.add("staged")
    c.add("staged", 2)
    c.add("in_place")
    c.add("offloaded", 4)
    c.left_alone("too_large")
    c.left_alone("too_large")
    c.left_alone("capturing")
    snap = c.snapshot()
    assert snap == CopyStats(staged=3, in_place=1, offloaded=4, emulated_waits=0,
                             left_alone={"too_large": 2, "capturing": 1})
    assert snap.total_left_alone == 3
    c.reset()
    assert c.snapshot() == CopyStats()


def test_snapshot_is_detached():
    c = StatsCounter()
    c.left_alone("blocking")
    snap = c.snapshot()
    c.left_alone("blocking")
    assert snap.left_alone == {"blocking": 1}


def test_unknown_names_rejected():
    c = StatsCounter()
    with pytest.raises(ValueError, match="unknown counter 'bogus'"):
        c.add("bogus")
    with pytest.raises(ValueError, match="unknown reason 'bogus'"):
        c.left_alone("bogus")


def test_thread_safe_counts():
    c = StatsCounter()

    def work():
        for _ in range(2000):
            c.add("offloaded")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.snapshot().offloaded == 8000

"""Issue 33: the choice between the look and the offload for a small readback where the host waits for it, made by
timing the loop both ways (``syncless.cc._readback_choice``), on a model clock."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from syncless.cc import _d2h, _emulation, _fast, _readback_choice
from syncless.cc._readback_choice import (FIRST_RUN, HALF, LOOK, MAX_RUN, OFFLOAD, SETTLE, WARMUP, WINDOW,
                                          ReadbackChoice)
from support.lane_block import LaneBlock


class _ModelClock:
    """A loop's clock: each readback's way sets how long the step after it takes (seconds)."""

    def __init__(self) -> None:
        self.now = 1.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


@pytest.fixture
def clock(monkeypatch):
    model = _ModelClock()
    monkeypatch.setattr(_readback_choice, "_clock", model)
    return model


# A new stream's first trial, its deciding readback included: the warm-up (its last readback opens the trial), the
# way in use for HALF readbacks, the other way for WINDOW, the way in use for HALF again.
FIRST_TRIAL = WARMUP - 1 + 2 * WINDOW + 1


def _loop(choice: ReadbackChoice, clock: _ModelClock, steps: int, step_s, jitter: float = 0.0, seed: int = 0):
    """Run ``steps`` readbacks; ``step_s(way)`` is the step after a readback made that way. Returns the ways."""
    rng = random.Random(seed)
    ways = []
    for _ in range(steps):
        way = choice.offload()
        ways.append(way)
        clock.now += step_s(way) * (1.0 + rng.uniform(-jitter, jitter))
    return ways


def test_it_starts_with_the_look_warms_up_and_times_the_look_on_both_sides_of_the_offload(clock):
    choice = ReadbackChoice()
    ways = _loop(choice, clock, FIRST_TRIAL - 1, lambda way: 420e-6)
    assert ways == [LOOK] * (WARMUP - 1 + HALF) + [OFFLOAD] * WINDOW + [LOOK] * HALF
    assert choice.trials == 0
    assert choice.offload() is LOOK  # the trial ends: equal steps keep the way in use
    # the first SETTLE + 1 intervals of each phase not counted (the first belongs to the way before)
    assert len(choice.current) == 2 * (HALF - SETTLE - 1) and len(choice.other) == WINDOW - SETTLE - 1
    assert choice.trials == 1 and choice.switches == 0 and choice.run == 2 * FIRST_RUN
    assert choice.offload() is LOOK and choice.left == 2 * FIRST_RUN - 1
    assert choice.last_trial == {LOOK: pytest.approx((420e-6, 420e-6)), OFFLOAD: pytest.approx((420e-6, 420e-6))}


def test_a_loop_that_runs_faster_offloaded_is_offloaded_and_rechecked_soon(clock):
    choice = ReadbackChoice()
    _loop(choice, clock, FIRST_TRIAL, lambda way: 420e-6 if way is OFFLOAD else 461e-6)
    assert choice.way is OFFLOAD and choice.switches == 1 and choice.run == FIRST_RUN
    assert choice.last_trial == {LOOK: pytest.approx((461e-6, 461e-6)), OFFLOAD: pytest.approx((420e-6, 420e-6))}
    reads = clock.reads
    ways = _loop(choice, clock, FIRST_RUN - 1, lambda way: 420e-6)
    assert set(ways) == {OFFLOAD} and clock.reads == reads  # the run between trials reads no clock


@pytest.mark.parametrize("way", [LOOK, OFFLOAD])
def test_a_gain_under_the_threshold_keeps_the_way_and_the_runs_double_up_to_the_bound(clock, way):
    choice = ReadbackChoice()
    choice.way = way
    slower = 1.0 / (1.0 - _readback_choice.MIN_GAIN / 2)
    runs = []
    while choice.trials < 6:
        trials = choice.trials
        _loop(choice, clock, 1, lambda w: 420e-6 if w is not way else 420e-6 * slower)
        if choice.trials > trials:
            runs.append(choice.run)
    assert choice.way is way and choice.switches == 0
    expected = [min(FIRST_RUN << n, MAX_RUN) for n in range(1, 7)]
    assert runs == expected and expected[-1] == MAX_RUN and expected[0] < MAX_RUN


def test_a_look_faster_by_the_threshold_takes_over_from_the_offload(clock):
    choice = ReadbackChoice()
    choice.way = OFFLOAD
    _loop(choice, clock, FIRST_TRIAL, lambda way: 400e-6 if way is LOOK else 440e-6)
    assert choice.way is LOOK and choice.switches == 1 and choice.run == FIRST_RUN


def test_the_first_intervals_of_a_window_do_not_count(clock):
    # The step after the change of way is long (the loop settling), the rest of the other way's steps shorter.
    choice = ReadbackChoice()
    count = {"other": 0}

    def step_s(way):
        if way is OFFLOAD:
            count["other"] += 1
            return 5e-3 if count["other"] <= SETTLE else 400e-6
        return 461e-6

    _loop(choice, clock, FIRST_TRIAL, step_s)
    assert choice.way is OFFLOAD


def test_a_host_that_speeds_up_through_a_trial_favours_neither_way(clock):
    # Every step 0.25% shorter than the one before, whatever the way: the second of two windows timed one after the
    # other would be some 6% faster (over MIN_GAIN), and the way after the first window would take over.
    for way in (LOOK, OFFLOAD):
        choice = ReadbackChoice()
        choice.way = way
        step = {"s": 500e-6}

        def step_s(_way):
            step["s"] *= 0.9975
            return step["s"]

        _loop(choice, clock, FIRST_TRIAL, step_s)
        assert choice.trials == 1 and choice.way is way and choice.switches == 0


SLOW_FIRST_STEPS = 20  # the warm-up and the first phase's unsettled intervals (16 + 4)


def test_a_new_streams_slow_first_steps_are_not_counted_against_the_way_in_use(clock):
    assert SLOW_FIRST_STEPS <= WARMUP + SETTLE
    # A loop's first steps (its allocator's pools filling, its first launches) are slow whichever the way.
    choice = ReadbackChoice()
    count = {"steps": 0}

    def step_s(way):
        count["steps"] += 1
        return 3e-3 if count["steps"] <= SLOW_FIRST_STEPS else (420e-6 if way is LOOK else 430e-6)

    _loop(choice, clock, FIRST_TRIAL, step_s)
    assert choice.trials == 1 and choice.way is LOOK and choice.switches == 0


def _pause_after(choice: ReadbackChoice, clock: _ModelClock, readbacks: int, gaps: int) -> list:
    """``readbacks`` steps of 420 us, then ``gaps`` readbacks each MAX_INTERVAL_S * 2 after the one before."""
    ways = _loop(choice, clock, readbacks, lambda way: 420e-6)
    for _ in range(gaps):
        clock.now += 2 * _readback_choice.MAX_INTERVAL_S
        ways.append(choice.offload())
    return ways


def test_a_pause_of_the_loop_keeps_the_way_and_times_both_ways_again_from_the_next_readback(clock):
    choice = ReadbackChoice()
    choice.way = OFFLOAD
    ways = _pause_after(choice, clock, WARMUP - 1 + HALF + 3, gaps=1)  # a pause in the other way's window
    assert ways[-1] is OFFLOAD and choice.trials == 0 and choice.switches == 0
    assert choice.current == [] and choice.other == []  # nothing timed before the pause counts
    ways = _loop(choice, clock, WARMUP - 2 + 2 * WINDOW + 2, lambda way: 400e-6 if way is OFFLOAD else 460e-6)
    # the readback after the pause opened the warm-up; the trial's deciding readback keeps the offload
    assert ways == [OFFLOAD] * (WARMUP - 2 + HALF) + [LOOK] * WINDOW + [OFFLOAD] * (HALF + 2)
    assert choice.trials == 1 and choice.way is OFFLOAD and choice.run == 2 * FIRST_RUN


def test_readbacks_made_now_and_then_take_the_look(clock):
    choice = ReadbackChoice()
    choice.way = OFFLOAD
    choice.run = MAX_RUN  # a loop that had kept the offload for long
    ways = _pause_after(choice, clock, 3, gaps=2)
    assert ways[-2:] == [OFFLOAD, LOOK] and choice.way is LOOK and choice.switches == 1
    assert choice.run == FIRST_RUN  # a change of way: its runs grow from the first one again
    assert _pause_after(choice, clock, 0, gaps=3) == [LOOK] * 3 and choice.switches == 1


def test_pauses_with_a_loop_between_them_each_keep_the_way(clock):
    choice = ReadbackChoice()
    choice.way = OFFLOAD
    for _ in range(5):  # a server: a few steps per request, a pause between requests
        ways = _pause_after(choice, clock, 3, gaps=1)
        assert ways[-1] is OFFLOAD
    assert choice.way is OFFLOAD and choice.switches == 0


@pytest.mark.parametrize("faster", [LOOK, OFFLOAD])
@pytest.mark.parametrize("gain", [0.05, 0.12])
def test_over_a_long_loop_the_faster_way_takes_almost_every_readback(clock, faster, gain):
    # 5% jitter on every step, as a shared host gives
    choice = ReadbackChoice()
    ways = _loop(choice, clock, 20_000, lambda way: 420e-6 if way is faster else 420e-6 * (1 + gain), jitter=0.05,
                 seed=int(gain * 100) + faster)
    share = ways[2_000:].count(faster) / len(ways[2_000:])
    assert share > 0.97, share


def test_a_pinned_way_is_kept_untimed(clock):
    choice = ReadbackChoice()
    choice.pin(OFFLOAD)
    ways = _loop(choice, clock, 10_000, lambda way: 1e-3 if way is OFFLOAD else 1e-6)
    assert set(ways) == {OFFLOAD} and clock.reads == 0


# -- the lane asks it where the host waits ------------------------------------------------------------------------


def _emulated_lane(monkeypatch, way):
    from syncless.cc import _helper

    log = []
    record = _d2h._D2HStream(object())
    record.choice.pin(way)
    lane = SimpleNamespace(current_device=lambda: 0, capturing=lambda: False, raw_stream=lambda index: 7,
                           strided="strided", grad_enabled=lambda: True,
                           stream_query=lambda stream: log.append("query") or True,
                           empty_strided=lambda shape, stride, dtype, pin_memory: "result")
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 7): record})
    monkeypatch.setattr(_helper, "ENABLED", [False])
    monkeypatch.setattr(_emulation, "_installed", True)
    monkeypatch.setattr(_fast, "_read_back_into",
                        lambda lane, dst, src, device, index, rec: log.append(("at the call", dst)) or dst)
    monkeypatch.setattr(_d2h, "pinned_block", lambda src, dtype: "pinned")
    monkeypatch.setattr(_d2h, "offload_block", lambda rec, dst, src, index: log.append(("offloaded", dst)) or 1)
    return lane, record, log


def test_where_the_host_waits_the_look_reads_back_at_the_call(monkeypatch):
    lane, record, log = _emulated_lane(monkeypatch, LOOK)
    assert _fast._offload(lane, LaneBlock(), "cpu", 1 << 20) == "result"
    assert log == [("at the call", "result")]


def test_where_the_host_waits_the_offload_way_offloads_without_looking(monkeypatch):
    lane, record, log = _emulated_lane(monkeypatch, OFFLOAD)
    assert _fast._offload(lane, LaneBlock(), "cpu", 1 << 20) == "pinned"
    assert log == [("offloaded", "pinned")]  # no query, no read at the call


def test_every_small_readback_where_the_host_waits_is_asked_about_even_behind_a_pending_offload(monkeypatch):
    lane, record, log = _emulated_lane(monkeypatch, LOOK)
    asked = []
    record.choice = SimpleNamespace(offload=lambda: asked.append(1) or False)
    monkeypatch.setattr(_d2h, "_PENDING", [1])
    record.last_job = 3  # unfinished: offloaded whatever the way
    assert _fast._offload(lane, LaneBlock(), "cpu", 1 << 20) == "pinned"
    assert asked == [1] and log == [("offloaded", "pinned")]


def test_a_large_readback_is_not_timed(monkeypatch):
    lane, record, log = _emulated_lane(monkeypatch, LOOK)
    record.choice = SimpleNamespace(offload=lambda: pytest.fail("asked about a large readback"))
    block = LaneBlock()
    block.nbytes = _fast.READ_BACK_NOW_BYTES
    assert _fast._offload(lane, block, "cpu", 1 << 20) == "pinned"

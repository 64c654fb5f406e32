"""Which way a small readback from one D2H stream goes where the host waits for it: the look, or straight to the
offload. Chosen by timing the loop that makes the readbacks, both ways, now and then.

Where the host waits for a D2H copy (CC, or its emulation), a small readback can be made two ways
(:mod:`._fast`):

- **the look**: read back at the call if the D2H stream drains within :data:`._fast.DRAIN_LOOK_S` (else
  offload). The host waits for the GPU's queue ahead of the copy, then for the transfer; the GPU then idles while
  the host makes the next step's first calls. Cheapest for the host.
- **the offload**: a device snapshot and an event now, the copy later, run by whichever thread waits for it. The
  host does not wait for the GPU here, and pays the offload's own calls instead (some 40-60 us a step on an
  H200's host, run 63).

Which is faster depends on the loop, not on the copy. A loop whose GPU work takes longer than its host's calls
(the GPU behind by a step) loses a bubble at each look and has the host time the offload needs to spare: run 63's
batch-1 loop, 0.929x plain tokens/s when read back at the call (the transfer floor), 0.999x offloaded. A loop
whose host is the bottleneck finds the stream drained at the call, and every offload's call is on its critical
path (run 53: 0.880x at the call, 0.804x offloaded). The look alone cannot tell them apart: reading at the call
keeps the GPU close behind the host, so the next look drains in time again, and a loop can settle in either way
whichever is faster (runs 61 and 63, the same loop on like hosts: 0.858x at the call, 0.999x offloaded).

So the interval between one readback and the next (a decode loop's step) is measured in a trial of three
phases: :data:`HALF` readbacks the way in use, :data:`WINDOW` the other way, :data:`HALF` the way in use again (the
first :data:`SETTLE` intervals of each phase not counted, while the loop settles). The other way takes over if its
median is :data:`MIN_GAIN` below the way in use's; either way the result is used for the next run of readbacks,
unmeasured: :data:`FIRST_RUN`, doubled each time the trial keeps the way in use, up to :data:`MAX_RUN`. Timing the
way in use on both sides of the other cancels a host whose speed drifts through the trial (the samples of both
ways then have the same mean time): with the two windows one after the other, a host that sped up during a trial
made the second way look faster (session 23, run 69: the first trial of the bench's host-bound loop chose the
offload, 0.821x plain, where the look gives 0.86-0.87x). A trial's cost: :data:`WINDOW` readbacks the slower way in
every run (8% of them at first, 2% once settled).

Readbacks further apart than :data:`MAX_INTERVAL_S` are no loop's steps. One such gap is a loop that paused (a
server between requests, a benchmark between its rounds): the trial starts again from that readback, the way
kept, after :data:`WARMUP` readbacks the way in use, untimed (a loop's first steps after a pause, or a new D2H
stream's first readbacks, run slower than its steady state, and would be counted against the way timed first). Two in a row are readbacks made now and then, which the look serves best (the GPU has drained by then):
the look is used, and the trial starts again too. (Until session 21 the first gap ended the trial with the look,
for a run of :data:`FIRST_RUN` readbacks, so a loop that paused during a trial went back to the look.)

Host only, no CUDA call: one counter decrement per readback between trials, a clock read during them. The
caller holds the GIL; two threads reading back from one D2H stream at once share its choice (each still gets a
correct copy either way).
"""

from __future__ import annotations

import statistics
from time import perf_counter as _clock

LOOK = False  # read back at the call if the stream drains within the look (else offload)
OFFLOAD = True  # offload without looking

WINDOW = 24  # readbacks a trial times the other way, between two halves as long timed the way in use
HALF = WINDOW // 2
SETTLE = 4  # of a phase's intervals, the first ones not counted (the loop settles into the way)
WARMUP = 16  # readbacks the way in use, untimed, before a new stream's or a paused loop's trial
FIRST_RUN = 256  # readbacks the chosen way then takes untimed
MAX_RUN = 1024  # a loop that changes (prefill to decode) is timed again within about a second
MIN_GAIN = 0.02  # the other way takes over when its median interval is at least this much shorter
MAX_INTERVAL_S = 0.05  # longer between two readbacks: not a loop's step (the trial starts again; twice: the look)

_RUN, _WARMING, _TIMING_CURRENT, _TIMING_OTHER, _TIMING_BACK = 0, 1, 2, 3, 4


class ReadbackChoice:
    """One D2H stream's way for its small readbacks where the host waits (the look, or the offload); see the
    module docstring. :meth:`offload` is asked once per such readback, before anything is enqueued."""

    __slots__ = ("way", "phase", "left", "span", "run", "last", "current", "other", "trials", "switches",
                 "after_gap", "last_trial")

    def __init__(self) -> None:
        self.way = LOOK
        self.run = FIRST_RUN
        self.trials = 0  # trials decided (for tests and probes)
        self.switches = 0  # trials that changed the way
        self.after_gap = False  # the last timed readback came more than MAX_INTERVAL_S after the one before
        # The last trial decided, for probes and the bench's progress lines: {way: (median, mean) interval, seconds}.
        self.last_trial: dict[bool, tuple[float, float]] = {}
        self._begin_trial(warm=True)

    def _begin_trial(self, warm: bool = False) -> None:
        """Time both ways from the next readback on (``warm``: after :data:`WARMUP` readbacks untimed)."""
        if warm:
            self._enter(_WARMING, WARMUP)
        else:
            self._enter(_TIMING_CURRENT, HALF)
        self.last = 0.0
        self.current: list[float] = []
        self.other: list[float] = []

    def _enter(self, phase: int, span: int) -> None:
        """Begin ``phase``, ``span`` readbacks long (counting the one that begins it, which the caller is making)."""
        self.phase, self.left, self.span = phase, span, span

    def pin(self, way: bool) -> None:
        """Use ``way`` for every readback from now on, untimed (probes and tests compare the two ways)."""
        self.way = way
        self._enter(_RUN, 0)
        self.left = float("inf")

    def offload(self) -> bool:
        """Whether this readback goes straight to the offload (True) or takes the look (False)."""
        if self.phase == _RUN:
            self.left -= 1
            if self.left <= 0:
                self._begin_trial()
            return self.way
        return self._timed()

    def _timed(self) -> bool:
        now = _clock()
        last, self.last = self.last, now
        phase = self.phase
        if last:
            interval = now - last
            if interval > MAX_INTERVAL_S:
                return self._after_gap(now)
            self.after_gap = False
            # (the first intervals of a phase belong partly to the way before; the warm-up's to no way)
            if phase != _WARMING and self.span - self.left > SETTLE:
                (self.other if phase == _TIMING_OTHER else self.current).append(interval)
        self.left -= 1
        if self.left > 0:
            return not self.way if phase == _TIMING_OTHER else self.way
        # This readback is the first of the next phase.
        if phase == _WARMING:
            self._enter(_TIMING_CURRENT, HALF)
            return self.way
        if phase == _TIMING_CURRENT:
            self._enter(_TIMING_OTHER, WINDOW)
            return not self.way
        if phase == _TIMING_OTHER:
            self._enter(_TIMING_BACK, HALF)
            return self.way
        # The way in use is kept unless the other wins by MIN_GAIN (run 68 tried sending a tie to the offload: no
        # gain, and a cost; docs/cc.md, "The GPU-paced loop, session 21").
        faster = statistics.median(self.other) < statistics.median(self.current) * (1.0 - MIN_GAIN)
        self.last_trial = {self.way: (statistics.median(self.current), statistics.fmean(self.current)),
                           not self.way: (statistics.median(self.other), statistics.fmean(self.other))}
        self._end_trial(not self.way if faster else self.way, kept=not faster)
        return self.way

    def _after_gap(self, now: float) -> bool:
        """A readback more than :data:`MAX_INTERVAL_S` after the last: a trial again from here (this readback opens its
        warm-up), the way kept after one gap, the look after a second gap in a row (its runs then grow from
        :data:`FIRST_RUN` again, as after any change of way)."""
        if self.after_gap and self.way != LOOK:
            self.way = LOOK
            self.switches += 1
            self.run = FIRST_RUN
        self.after_gap = True
        self._begin_trial(warm=True)
        self.last = now
        self.left -= 1
        return self.way

    def _end_trial(self, way: bool, kept: bool) -> None:
        self.trials += 1
        if way != self.way:
            self.switches += 1
        self.way = way
        self.run = min(self.run * 2, MAX_RUN) if kept else FIRST_RUN
        self.phase = _RUN
        self.left = self.run

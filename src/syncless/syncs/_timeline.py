"""The syncs on a timeline: ranges in torch.profiler and on NVTX, and a record for a trace file or a picture.

Three sinks, each off until asked for:

* **torch.profiler**: while a ``torch.profiler.profile`` is active, each
  recorded sync becomes a ``record_function`` range named
  ``syncless: hidden sync file.py:123 (fn)`` on the thread that blocked;
* **NVTX** (``SYNCLESS_SYNC_NVTX=1`` or :func:`set_nvtx`): the same range
  through ``torch.cuda.nvtx`` (push/pop, on the thread that blocked);
* **the record** (:func:`record_timeline`): each sync with its time and
  each outermost checked region, kept (bounded) for
  ``SyncReport.to_chrome_trace`` and ``SyncReport.plot``.

A range can only start *now* (``record_function`` and NVTX have no start
time to pass), so where the detector surrounds the blocking call, the range
is opened before the call and closed after it: the CUPTI layer does, at the
call's entry and exit callbacks (:func:`open_span`, :func:`close_span`).
Where a sync is seen only after it returned (torch's debug-mode warning,
delivered when the op returns; a wrapped wait, reported after it), the
range is a marker placed where it was seen, right after torch's own range
of the op. ``docs/syncs.md`` ("On the timeline") says why.

Times are ``time.time_ns()`` (CLOCK_REALTIME), the clock whose microseconds
torch.profiler's chrome trace counts from its ``baseTimeNanoseconds``.
Nothing here enqueues GPU work or blocks the host.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from syncless._core import config
from syncless._core.errors import ConfigError
from syncless.syncs import _state

SYNC_PREFIX = "syncless: hidden sync"
REGION_NAME = "syncless: checked region"
#: The most syncs (and, separately, checked regions) the record keeps; older ones are dropped and counted.
MAX_KEPT = 100_000
# How far back a torch-level report looks for the CUPTI views of its own call on the record.
_LOOKBACK = 8

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimelineSync:
    """One recorded sync on the timeline.

    Attributes:
        start_ns: when the host started to wait (``time.time_ns()``); where it was not timed, when it was seen.
        blocked_ns: host time blocked (0 when not timed: only CUPTI times a sync).
        pid, tid: the process and the thread's native id (``threading.get_native_id()``, the profiler's tid).
        thread: the thread's name.
        filename, lineno, function: the user's line that made the sync.
        kind, operation, mode: as in the report, and the mode it was recorded in.
        layers: which layers saw it; apis: the CUDA calls that blocked (CUPTI).
        stack: the user's stack (the first of its call site only; later ones repeat it by site).
        timed: whether CUPTI timed it.
    """

    start_ns: int
    blocked_ns: int
    pid: int
    tid: int
    thread: str
    filename: str
    lineno: int
    function: str
    kind: str
    operation: str
    mode: str
    layers: tuple[str, ...]
    apis: dict[str, int] = field(default_factory=dict)
    stack: str = ""
    timed: bool = False

    @property
    def site(self) -> str:
        return f"{self.filename}:{self.lineno}"

    @property
    def name(self) -> str:
        return range_name(self.filename, self.lineno, self.function)


@dataclass(frozen=True)
class TimelineRegion:
    """One outermost checked region: from entry to exit, on one thread."""

    start_ns: int
    end_ns: int
    pid: int
    tid: int
    thread: str


@dataclass
class Timeline:
    """What the record kept: syncs and regions (oldest first), and how many were dropped past :data:`MAX_KEPT`."""

    syncs: list[TimelineSync] = field(default_factory=list)
    regions: list[TimelineRegion] = field(default_factory=list)
    dropped_syncs: int = 0
    dropped_regions: int = 0


def range_name(filename: str, lineno: int, function: str) -> str:
    """The name of a sync's range: ``syncless: hidden sync file.py:123 (fn)``."""
    return f"{SYNC_PREFIX} {os.path.basename(filename)}:{lineno} ({function})"


def _nvtx_from_env() -> bool:
    try:
        return bool(config.read("SYNCLESS_SYNC_NVTX"))
    except ConfigError as err:  # never fail the import for a bad value
        _log.warning("%s; NVTX ranges stay off", err)
        return False


class _State:
    """Process-wide: which sinks are on, and the record."""

    def __init__(self) -> None:
        self.nvtx = _nvtx_from_env()
        self.recording = False
        self.lock = threading.Lock()
        # (call key, thread ident, sync): the key lets a torch-level report take CUPTI's views of its call.
        self.syncs: collections.deque = collections.deque(maxlen=MAX_KEPT)
        self.regions: collections.deque = collections.deque(maxlen=MAX_KEPT)
        self.seen_syncs = 0
        self.seen_regions = 0
        self.on = self.nvtx  # recording or nvtx: the flag read per recorded sync, before the profiler's


state = _State()
_local = threading.local()  # span_key: the call key of this thread's latest range opened around the call


def _update() -> None:
    state.on = state.nvtx or state.recording
    _state.settings.timeline = state.recording


def _bool(on: object, caller: str) -> bool:
    if on is not True and on is not False:
        raise TypeError(f"{caller} expects a bool, got {type(on).__name__} {on!r}")
    return on


def set_nvtx(on: bool) -> None:
    """Put each recorded sync on the NVTX row too (``torch.cuda.nvtx``), or stop; overrides ``SYNCLESS_SYNC_NVTX``.

    Raises:
        TypeError: ``on`` is not a bool.
    """
    state.nvtx = _bool(on, "set_nvtx")
    _update()


def record_timeline(on: bool = True) -> None:
    """Keep each recorded sync with its time, and each checked region, for ``to_chrome_trace`` and ``plot``.

    Off by default (a sync then costs one flag read more); :func:`syncs.reset` forgets what was kept. At
    most :data:`MAX_KEPT` syncs and as many regions are kept, the newest.

    Raises:
        TypeError: ``on`` is not a bool.
    """
    state.recording = _bool(on, "record_timeline")
    _update()


def is_recording() -> bool:
    """Whether :func:`record_timeline` is on."""
    return state.recording


def _profiling() -> bool:
    profiler = sys.modules.get("torch.autograd.profiler")
    return profiler is not None and profiler._is_profiler_enabled is True


def is_live() -> bool:
    """Whether a recorded sync goes anywhere: the record or NVTX is on, or a torch.profiler is active."""
    return state.on or _profiling()


# -- ranges in the profiler and on NVTX ---------------------------------------------------------------

class _Span:
    """A range opened on this thread in the sinks that are on, closed by :func:`close_span`."""

    __slots__ = ("profiler", "nvtx")

    def __init__(self, name: str) -> None:
        self.profiler = None
        self.nvtx = False
        if _profiling():
            import torch.profiler

            self.profiler = torch.profiler.record_function(name)
            self.profiler.__enter__()
        if state.nvtx:
            import torch.cuda.nvtx

            torch.cuda.nvtx.range_push(name)
            self.nvtx = True


def close_span(span: _Span) -> None:
    """Close a range opened by :func:`open_span` (on the thread that opened it)."""
    if span.nvtx:
        import torch.cuda.nvtx

        torch.cuda.nvtx.range_pop()
    if span.profiler is not None:
        span.profiler.__exit__(None, None, None)


def open_span(start) -> _Span | None:
    """Open the range of a blocking call about to run at ``start`` (a frame inside it), if it is a sync.

    Called where the detector surrounds the call (the CUPTI layer's entry
    callback) and only when :func:`is_live`; None when the call is not a
    sync here (no checked region, an allow region, compile-time work) or
    no profiler or NVTX is on.
    """
    from syncless.syncs import _report

    if not (state.nvtx or _profiling()) or not _state.is_violation_context() or _report.is_under_compile(start):
        return None
    frame, compile_time, _ = _report._user_frame(start)
    if frame is None or compile_time:
        return None
    _local.span_key = _report.call_key(frame)
    return _Span(range_name(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))


def _marker(name: str) -> None:
    close_span(_Span(name))


# -- the record --------------------------------------------------------------------------------------

def _entry(violation, start_ns: int) -> TimelineSync:
    return TimelineSync(start_ns, violation.blocked_ns, os.getpid(), threading.get_native_id(),
                        threading.current_thread().name, violation.filename, violation.lineno,
                        violation.function, violation.kind, violation.operation, _state.settings.mode,
                        tuple(violation.layers), dict(violation.apis), violation.stack, violation.timed)


def _keep(key, entry: TimelineSync) -> None:
    with state.lock:
        state.syncs.append((key, threading.get_ident(), entry))
        state.seen_syncs += 1


def take_cupti(violation) -> None:
    """Keep a blocking CUDA call CUPTI saw in a checked region (at its exit; its range was opened around it)."""
    if state.recording:
        _keep(violation.call_key, _entry(violation, violation.at_ns - violation.blocked_ns))


def take_reported(violation) -> None:
    """Put a torch-level report (torch's warning, a wrapper's) on the timeline, after CUPTI's view was merged in.

    Its range is a marker where it was seen, unless a range was already
    opened around its call (CUPTI's). On the record it replaces the CUPTI
    views of the same call kept just before, starting where the first began.
    """
    if not is_live():
        return
    key = violation.call_key
    if key is not None and key == getattr(_local, "span_key", None):
        _local.span_key = None  # its CUDA calls had their ranges around them
    elif state.nvtx or _profiling():
        _marker(range_name(violation.filename, violation.lineno, violation.function))
    if not state.recording:
        return
    start_ns = violation.at_ns - violation.blocked_ns
    ident = threading.get_ident()
    with state.lock:
        kept = state.syncs
        for index in range(len(kept) - 1, max(len(kept) - 1 - _LOOKBACK, -1), -1):
            held_key, held_ident, held = kept[index]
            if key is not None and held_key == key and held_ident == ident and held.layers == ("cupti",):
                start_ns = min(start_ns, held.start_ns)
                del kept[index]
                state.seen_syncs -= 1
    _keep(key, _entry(violation, start_ns))


def _take_region(started_ns: int) -> None:
    with state.lock:
        state.regions.append(TimelineRegion(started_ns, time.time_ns(), os.getpid(), threading.get_native_id(),
                                            threading.current_thread().name))
        state.seen_regions += 1


_state.on_region_closed = _take_region


def snapshot() -> Timeline | None:
    """What the record holds now (None if :func:`record_timeline` was never on and nothing is kept)."""
    with state.lock:
        if not state.recording and not state.seen_syncs and not state.seen_regions:
            return None
        return Timeline([entry for _, _, entry in state.syncs], list(state.regions),
                        state.seen_syncs - len(state.syncs), state.seen_regions - len(state.regions))


def forget() -> None:
    """Drop what the record holds (``syncs.reset()``)."""
    with state.lock:
        state.syncs.clear()
        state.regions.clear()
        state.seen_syncs = state.seen_regions = 0

"""One sync, not three records: merging CUPTI's view of a Python call with torch's and the wrappers'.

torch and the wrappers report a sync once per Python call; CUPTI reports
every blocking driver call inside it. The two meet in the state of the
outermost checked region of a thread (or task), :class:`RegionEvents`,
keyed by the user's frame and the instruction it is executing
(:func:`._report.call_key`):

* a wrapper runs its wait inside an allow scope and reports *after* it
  returns (so a call torch refuses raises torch's error alone): the CUDA
  calls it made wait in ``joins`` and the wrapper's report takes those with
  its key; a report that came first opens an event that later CUDA calls of
  the same Python call join;
* torch's debug-mode warning is buffered by torch and delivered when the op
  returns, *after* the CUDA calls, so CUPTI's events wait (``pending``) and
  the warning takes those with its key (a warning that took none opens an
  event like a wrapper's, in case it came first);
* a pending CUPTI event is recorded on its own (layer ``cupti``) once
  something else happens on the thread, the region ends, or a report is
  taken. Each blocking call of a Python call torch does not see counts:
  ``empty_cache()`` that frees three segments is three ``cudaFree``.

In ``error`` mode a CUPTI-only sync cannot raise through the driver; it is
raised when the outermost region exits (:func:`close_region`).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from types import FrameType

from syncless._core.errors import SyncViolation
from syncless.syncs import _report
from syncless.syncs._report import KIND_WAIT, LAYER_CUPTI, LAYER_WRAPPER, SyncWarning, Violation, recorder
from syncless.syncs._state import settings


class RegionEvents:
    """The syncs of one outermost checked region of one thread (or task), while CUPTI watches.

    Attributes:
        pending: CUPTI events no torch-level report has claimed yet.
        joins: ``(call key, event)`` of CUDA calls made inside an allow scope, waiting for the wrapper's report.
        open_key, open_site: the wrapper's event that CUDA calls of its Python call join.
        open_blocked_ns: host time those calls took so far.
        to_raise: in ``error`` mode, the first CUPTI-only sync, raised when the region exits.
        warning_error: a ``SyncWarning`` that a warnings filter turned into an error while the events were
            recorded where nothing may raise (inside a CUPTI callback, or a report); raised when the region exits.

    Bounded however long the region runs: CUPTI-only syncs of one Python call site held back together are one
    entry with a count (``Violation.repeats``) and one stack, and so are the calls held for a wrapper.
    """

    def __init__(self) -> None:
        self.pending: list[Violation] = []
        self.joins: list[tuple[tuple | None, Violation]] = []
        self.open_key: tuple | None = None
        self.open_site: tuple[str, int, str] | None = None
        self.open_blocked_ns = 0
        self.to_raise: Violation | None = None
        self.warning_error: Warning | None = None
        _live_events.add(self)


_events_lock = threading.RLock()
_live_events: "weakref.WeakSet[RegionEvents]" = weakref.WeakSet()


def _flush(events: RegionEvents, may_raise: bool = False) -> None:
    """Record the CUPTI events that no torch-level report claimed (under ``_events_lock``).

    All are recorded before any is warned about: a warnings filter that turns
    ``SyncWarning`` into an error raises at the first warning. That error is
    raised here only when ``may_raise``; otherwise (inside a CUPTI callback,
    where raising would go through the driver call) it is kept for the region's exit.
    """
    pending, events.pending = events.pending, []
    for violation in pending:
        recorder.add(violation)
    mode = settings.mode
    for violation in pending:
        if mode == "warn":
            try:
                warnings.warn_explicit(violation.message(), SyncWarning, violation.filename, violation.lineno,
                                       registry=None)
            except SyncWarning as err:  # a filter made it an error
                if events.warning_error is None:
                    events.warning_error = err
        elif mode == "error" and events.to_raise is None:
            events.to_raise = violation
    if may_raise and events.warning_error is not None:
        err, events.warning_error = events.warning_error, None
        raise err


def flush_all() -> None:
    """Record every held-back CUPTI event of every region (before a report, and when CUPTI lets go)."""
    with _events_lock:
        for events in list(_live_events):
            _flush(events)


recorder.before_report.append(flush_all)


def cupti_event(violation: Violation) -> None:
    """Take a blocking CUDA call CUPTI saw in a checked region (a violation context)."""
    events = _report.region_events.get()
    if events is None:
        # A region entered without the backend's bookkeeping: record it now (never raise inside a callback).
        try:
            _report.record_and_act(violation, None, may_raise=False)
        except SyncWarning:  # a filter made the warning an error; recorded, but nothing may raise here
            pass
        return
    with _events_lock:
        if events.open_key is not None and events.open_key == violation.call_key:
            _join_open(events, violation)
            return
        events.open_key = None
        last = events.pending[-1] if events.pending else None
        if last is not None and last.call_key != violation.call_key and not _same_site(last, violation):
            # A new Python call: what is held is recorded first. Not for the same site again: a loop's next call of
            # a function gets a new frame, whose id (part of the key) is reused only when the allocator happens to.
            _flush(events)
        for held in events.pending:
            if _same_site(held, violation):
                # The same call site again (the next step of a loop, or another blocking call of one Python call):
                # one entry with a count, one stack, whatever the number of steps.
                _repeat(held, violation)
                return
        events.pending.append(violation)


def _same_site(held: Violation, again: Violation) -> bool:
    return held.kind == again.kind and held.operation == again.operation


def _repeat(held: Violation, again: Violation) -> None:
    """Fold one more CUPTI-only sync of ``held``'s call site into it (counted, unlike ``Violation.absorb``)."""
    held.blocked_max_ns = max(held.blocked_max_ns or held.blocked_ns, again.blocked_ns)
    held.absorb(again)
    held.repeats += 1


def cupti_join(start: FrameType | None, api: str, reason: str, blocked_ns: int) -> None:
    """Take a blocking CUDA call seen inside an allow scope: it counts only inside a wrapper's open event.

    The wrappers of host waits run the wait inside an allow scope (so torch's
    own warning is not a second report); the call they make still belongs to
    the sync they reported.
    """
    events = _report.region_events.get()
    if events is None:
        return
    key = _report.user_call_key(start)
    with _events_lock:
        joined = Violation(KIND_WAIT, "", "", 0, "", "", "", "", (LAYER_CUPTI,), {api: 1}, {api: reason}, blocked_ns, True)
        if events.open_key is not None and key == events.open_key:
            _join_open(events, joined)
        elif key is not None:
            # The wrapper reports after its wait returns: hold the call for that report (dropped if none comes).
            events.joins = [j for j in events.joins if j[0] == key]
            if events.joins:
                events.joins[-1][1].absorb(joined)  # one entry per call, however often it repeats unclaimed
            else:
                events.joins.append((key, joined))


def _join_open(events: RegionEvents, violation: Violation) -> None:
    first_timing = events.open_blocked_ns == 0
    events.open_blocked_ns += violation.blocked_ns
    for api in violation.apis:
        recorder.annotate(events.open_site, api, violation.reasons.get(api, ""), violation.blocked_ns,
                          events.open_blocked_ns, first_timing)
        first_timing = False


def close_region(events: RegionEvents | None, failing: bool) -> None:
    """The outermost region holding ``events`` exits: record what is held back, raise in error mode.

    Raises:
        SyncViolation: in ``error`` mode, for the first CUPTI-only sync of the
            region, unless the region is already exiting with an exception.
    """
    if events is None:
        return
    with _events_lock:
        _live_events.discard(events)
        _flush(events)
        violation, events.to_raise = events.to_raise, None
        warning_error, events.warning_error = events.warning_error, None
    if warning_error is not None and not failing:
        raise warning_error
    if violation is not None and not failing and settings.mode == "error":
        err = SyncViolation(violation.message())
        err.violation = violation
        raise err


def _merge_into_torch_level(events: RegionEvents, violation: Violation) -> None:
    """A torch-level report (``_report.handle``): take CUPTI's pending view of the same call; open a wrapper's."""
    with _events_lock:
        same = [p for p in events.pending if p.call_key == violation.call_key]
        if len(same) != len(events.pending):
            events.pending = [p for p in events.pending if p.call_key != violation.call_key]
            _flush(events)
        events.pending = []
        for cupti_view in same:
            violation.absorb(cupti_view)
        joins, events.joins = events.joins, []
        for key, cupti_view in joins:
            if key == violation.call_key:
                violation.absorb(cupti_view)
        if LAYER_WRAPPER in violation.layers or not same:
            # A wrapper reports before its call runs, and so would a torch warning that torch did not
            # buffer (it took no CUDA call of its own): the CUDA calls of that call join this sync.
            events.open_key, events.open_site = violation.call_key, recorder.key(violation)
            events.open_blocked_ns = violation.blocked_ns
        else:
            events.open_key = None


_report.merge_into_torch_level = _merge_into_torch_level

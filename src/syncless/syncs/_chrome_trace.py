"""Chrome trace-event JSON of the timeline, for Perfetto and ``chrome://tracing``.

One complete event (``"ph": "X"``) per sync, with its site, stack, kind,
mode and blocked time in ``args``; one per outermost checked region
(``syncless: checked region``); the threads' names as metadata events.

``ts`` is in microseconds from ``baseTimeNanoseconds``, on CLOCK_REALTIME
(``time.time_ns()``), with the base torch.profiler (kineto) uses: the epoch
second floored to a multiple of 7,889,238 s. So a sync's ``ts`` here and a
range's ``ts`` in ``prof.export_chrome_trace()`` count from the same point,
and the two files' ``traceEvents`` can be put in one file as they are
(``docs/syncs.md``, "On the timeline", says how this was checked).
"""

from __future__ import annotations

import json
import os

from syncless.syncs._timeline import REGION_NAME, Timeline

#: kineto's ChromeTraceBaseTime step: the base is the epoch floored to a multiple of this many seconds.
KINETO_BASE_STEP_S = 7_889_238

NO_TIMELINE = ("this report holds no timeline: call syncs.record_timeline(True) before the code runs "
               "(syncless trace --timeline does), then take syncs.report()")


def base_ns(at_ns: int) -> int:
    """The ``baseTimeNanoseconds`` torch.profiler writes for a trace taken at ``at_ns`` (epoch ns)."""
    step_ns = KINETO_BASE_STEP_S * 1_000_000_000
    return at_ns // step_ns * step_ns


def _us(ns: int, base: int) -> float:
    return round((ns - base) / 1000, 3)


def trace_events(timeline: Timeline, backend: str = "", at_ns: int | None = None) -> dict:
    """The trace as a JSON-ready dict (``traceEvents``, ``baseTimeNanoseconds``, ``displayTimeUnit``, ``otherData``).

    Args:
        at_ns: the time the base is taken from (default: the first event's, else now).
    """
    starts = [s.start_ns for s in timeline.syncs] + [r.start_ns for r in timeline.regions]
    if at_ns is None:
        import time

        at_ns = min(starts) if starts else time.time_ns()
    base = base_ns(at_ns)
    events: list[dict] = []
    threads: dict[tuple[int, int], str] = {}
    for region in timeline.regions:
        threads.setdefault((region.pid, region.tid), region.thread)
        events.append({"ph": "X", "cat": "syncless", "name": REGION_NAME, "pid": region.pid, "tid": region.tid,
                       "ts": _us(region.start_ns, base), "dur": _us(region.end_ns, region.start_ns)})
    for sync in timeline.syncs:
        threads.setdefault((sync.pid, sync.tid), sync.thread)
        events.append({
            "ph": "X", "cat": "syncless", "name": sync.name, "pid": sync.pid, "tid": sync.tid,
            "ts": _us(sync.start_ns, base), "dur": _us(sync.blocked_ns, 0),
            "args": {"site": sync.site, "function": sync.function, "kind": sync.kind, "operation": sync.operation,
                     "mode": sync.mode, "blocked_us": _us(sync.blocked_ns, 0), "timed": sync.timed,
                     "seen_by": "+".join(sync.layers), "cuda_calls": dict(sync.apis), "thread": sync.thread,
                     "stack": sync.stack},
        })
    for pid in sorted({pid for pid, _ in threads}):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"syncless (pid {pid})"}})
    for (pid, tid), name in sorted(threads.items()):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base,
        "otherData": {"syncless": {"backend": backend, "clock": "CLOCK_REALTIME (time.time_ns), microseconds "
                                   "from baseTimeNanoseconds, as torch.profiler's chrome trace",
                                   "dropped_syncs": timeline.dropped_syncs,
                                   "dropped_regions": timeline.dropped_regions}},
    }


def write(report, path) -> None:
    """Write ``report``'s timeline to ``path`` as Chrome trace-event JSON.

    Raises:
        ValueError: the report holds no timeline (``syncs.record_timeline()`` was not on).
    """
    if report.timeline is None:
        raise ValueError(NO_TIMELINE)
    trace = trace_events(report.timeline, report.backend)
    with open(os.fspath(path), "w", encoding="utf-8") as out:
        json.dump(trace, out)

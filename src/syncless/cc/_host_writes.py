"""Pinned host memory that a GPU copy may still be writing, so staged H2D copies read it in torch's order.

A staged (or in-place) H2D copy runs on the idle staging stream, which is
ordered after nothing the caller did. That is right for the *device* side
(the destination is new, or written on the current stream afterwards), but
not for the *host* source when a ``non_blocking`` D2H still has to write it::

    torch     S1 : D2H x -> h ........           S0 : [wait S1] H2D h -> y    (reads h after the D2H: correct)
    the shim  S1 : D2H x -> h ........    staging   : H2D h -> tmp            (reads h now: stale)

So every ``non_blocking`` D2H into pinned memory that the shim sees is noted
here under the byte range of the host storage it writes, until it is known
finished (a source overlapping that range waits for it, whichever storage
object it belongs to: two tensors made with ``torch.from_numpy`` over one
numpy array share bytes but not a storage): a plain
one (torch's own copy, on an ordinary stream) with an event recorded after
it on its stream; an offloaded one with its job number (see :mod:`._d2h`).
Before a staging copy reads host memory, :func:`order_after_pending_writes`
orders it after those writes: the staging stream waits for the event on the
GPU; for an offloaded copy, which no GPU stream holds yet, the host waits
for the worker's job (the worker never needs the caller to go on, so this
cannot deadlock). Under CC a D2H on an ordinary stream has finished when its
call returns, so only offloaded copies ever make the host wait there.

Pageable host memory needs nothing: a ``non_blocking`` D2H into it has
finished when the call returns.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

from syncless.cc import _raw, _streams

_lock = threading.Lock()
# Byte ranges of host storages a noted D2H may still be writing, indexed by the range's start: start -> a list of
# [end, entry], where entry is ("event", ev, the event's GPU) or ("job", ticket); _starts holds the starts in order, and _longest the
# longest range noted, so a staged H2D asks only the entries that can overlap its source (a bisect), not every
# one. Entries go when they are found done: at a lookup of their bytes, at the next note at the same start (the
# pinned allocator hands the same blocks out again), and in a trim of everything once the count doubles. The
# trim before rescanned every entry at each note past 64, 56 us a note with 64 copies in flight (issue 33).
_by_start: dict[int, list[list]] = {}
_starts: list[int] = []
# The same list (changed only in place): empty while no write is noted, which the fast lane reads before calling in.
NOTED_STARTS = _starts
_longest = [0]
_count = [0]
_TRIM_FLOOR = 64
_trim_at = [_TRIM_FLOOR]
# Set by install() when NVML reported Confidential Computing on: a D2H that torch issues has then finished when its
# call returns, so a readback the fast lane leaves to torch needs no note (._fast._read_back_now); the offloaded
# job needs no synchronize after its copy (._raw.run_copy_job, which reads the same list).
COPIES_FINISH_AT_CALL = _raw.COPIES_FINISH_AT_CALL
# Events of finished plain-D2H notes, for the next note on the same GPU (an event per copy cost a creation each), by
# GPU: a CUDA event is bound to the device it was first recorded on, and torch refuses to record it on another's
# stream (one pool for every GPU made a D2H on GPU 1 raise after its copy was enqueued; found in review).
_spare_events: dict[int, list[Any]] = {}


def _recycle(entry: tuple) -> None:
    """Keep the event of finished plain note ``entry`` for the next note on its GPU."""
    _spare_events.setdefault(entry[2], []).append(entry[1])


def _range(t: Any) -> tuple[int, int]:
    """The byte range of ``t``'s whole storage (a write anywhere in it is a conservative overlap)."""
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return start, start + max(storage.nbytes(), 1)


def _is_done(entry: tuple) -> bool:
    """Whether the noted write has finished and left nothing to report: a failed job stays until a staged H2D of
    its memory has raised its failure (issue 33 item 3: it was dropped as done, and the unwritten buffer uploaded)."""
    if entry[0] == "event":
        import torch

        return torch.cuda.Event.__mro__[1].query(entry[1])  # torch's own query (no D2H marks on this event)
    worker, seq = entry[1]
    if worker.is_pending(seq):
        return False
    return not worker.newest_failure >= seq or worker.failure_of(seq) is None


def _unfinished(items: list) -> list:
    """The entries of ``items`` not yet done; a finished plain note's event goes back for reuse."""
    kept = []
    for item in items:
        entry = item[1]
        if not _is_done(entry):
            kept.append(item)
        elif entry[0] == "event":
            _recycle(entry)
    return kept


def _trim() -> None:
    """Drop every finished entry (the caller holds ``_lock``); the next trim comes when the count has doubled."""
    for start in list(_starts):
        _set_bucket(start, _unfinished(_by_start[start]))
    _trim_at[0] = max(_TRIM_FLOOR, 2 * _count[0])


def _set_bucket(start: int, items: list) -> None:
    """Replace the entries at ``start`` (the caller holds ``_lock``), keeping the index and the count right."""
    old = _by_start.get(start)
    _count[0] += len(items) - (len(old) if old else 0)
    if items:
        if old is None:
            bisect.insort(_starts, start)
        _by_start[start] = items
    elif old is not None:
        del _by_start[start]
        del _starts[bisect.bisect_left(_starts, start)]
    if not _starts:
        _longest[0] = 0


def _remember(t: Any, entry: tuple) -> None:
    start, end = _range(t)
    with _lock:
        old = _by_start.get(start)
        items = _unfinished(old) if old else []
        items.append([end, entry])
        _set_bucket(start, items)
        _longest[0] = max(_longest[0], end - start)
        if _count[0] >= _trim_at[0]:
            _trim()


def _overlapping(start: int, end: int) -> list[tuple[int, list]]:
    """``(start, item)`` of every entry whose range overlaps ``[start, end)`` (the caller holds ``_lock``)."""
    low = bisect.bisect_right(_starts, start - _longest[0])
    high = bisect.bisect_left(_starts, end)
    return [(first, item) for first in _starts[low:high] for item in _by_start[first] if item[0] > start]


def note_plain_d2h(dst: Any, stream: Any) -> None:
    """Note a ``non_blocking`` D2H torch just enqueued on ``stream`` into host ``dst`` (GPU-side event record).

    Does nothing for pageable ``dst``. Does not block the host.
    """
    if not dst.is_pinned():
        return
    import torch

    index = stream.device_index
    try:
        event = _spare_events[index].pop()  # (another thread may take the last one between a look and a pop)
    except (KeyError, IndexError):
        event = torch.cuda.Event()
    _streams.record_event_raw(event, stream)
    _remember(dst, ("event", event, index))


def note_offloaded_d2h(dst: Any, ticket: Any) -> None:
    """Note offloaded D2H job ``ticket`` (its worker and number) into host ``dst`` (host-only bookkeeping)."""
    _remember(dst, ("job", ticket))


def _range_if_noted_nearby(src: Any) -> tuple[int, int] | None:
    """``src``'s storage byte range if a noted range may overlap it, else None (two bisects, no lock).

    No noted range can overlap ``[start, end)`` when none starts in ``[start - longest, end)``: the common case (a
    ring of input buffers that no D2H writes). An entry another thread notes meanwhile is a copy issued
    concurrently with the caller's, which nothing orders before it.
    """
    if not _starts:
        return None
    start, end = _range(src)
    if bisect.bisect_right(_starts, start - _longest[0]) >= bisect.bisect_left(_starts, end):
        return None
    return start, end


def settle_for_host_read(src: Any) -> bool:
    """Make host ``src``'s bytes final for a read on the host now, if that needs no GPU-side wait; return whether
    they are.

    The host waits for the offloaded copies still writing it (their jobs), as before a staged copy. A plain D2H
    (torch's own copy, on some stream) whose event has not fired makes this False, waiting for nothing more: only
    a GPU-side wait would order a read after it without blocking, so the caller stages the copy
    (:func:`order_after_pending_writes`). Under CC such a copy has always finished when its call returned.

    Raises:
        D2HCopyError: an offloaded copy into ``src``'s memory failed (its bytes were never written).
    """
    found = _range_if_noted_nearby(src)
    if found is None:
        return True
    start, end = found
    pending = _unfinished_writes(start, end)
    if any(entry[0] == "event" for entry in pending):
        return False
    if pending:
        from syncless.cc import _d2h

        _d2h.wait_for_tickets([entry[1] for entry in pending], raise_errors=False)
        _unfinished_writes(start, end)  # drops them now that they are done, or raises a failure among them
    return True


def wait_for_offloaded_writes(src: Any) -> None:
    """Before torch's own copy reads host ``src`` (an upload the shim leaves to torch): the host waits for the
    offloaded copies still writing it, as before a staged copy; a failure among them is raised.

    A plain D2H still writing ``src`` is not waited for: torch's copy is ordered after it only by what the program
    ordered (a stream wait, a synchronize), which holds for torch's own copy as it is; under CC it has finished at
    its call. Blocks the host only while such an offloaded copy is unfinished.

    Reads only the offloaded copies' entries: a plain note's event is never queried here (found in review: the
    query of an event is not allowed while a graph captures, and the shim leaves uploads to torch then).

    Raises:
        D2HCopyError: an offloaded copy into ``src``'s memory failed (once per thread, as for a staged upload).
    """
    try:
        found = _range_if_noted_nearby(src)
    except RuntimeError:
        return  # no memory of its own to read (torch raises at its storage's address): nothing of it is noted
    if found is None:
        return
    start, end = found
    pending = _offloaded_writes(start, end)
    if pending:
        from syncless.cc import _d2h

        _d2h.wait_for_tickets(pending, raise_errors=False)
        _offloaded_writes(start, end)  # raises a failure among them that this thread has not had


def _offloaded_writes(start: int, end: int) -> list:
    """The tickets of the offloaded copies over ``[start, end)`` still writing; raise the first failed one's error
    if this thread has not had it (it then has). Drops nothing (the other lookups do)."""
    failed = None
    pending = []
    with _lock:
        for _, item in _overlapping(start, end):
            entry = item[1]
            if entry[0] != "job":
                continue
            worker, seq = entry[1]
            if worker.is_pending(seq):
                pending.append(entry[1])
            elif failed is None and worker.newest_failure >= seq:
                failed = worker.claim_failure(seq)  # None: it did not fail, or this thread had it
    if failed is not None:
        raise failed
    return pending


def order_after_pending_writes(staging: Any, src: Any) -> None:
    """Order a copy about to read host ``src`` on ``staging`` after the noted D2H copies still writing it.

    A plain D2H: ``staging`` waits for its event (GPU-side). An offloaded
    one: the host waits for its job (it blocks only in that case).

    Raises:
        D2HCopyError: an offloaded copy into ``src``'s memory failed (raised by the first staged H2D that reads
            it: the memory was never written, and uploading it as if it had been would pass garbage on).
    """
    found = _range_if_noted_nearby(src)
    if found is None:
        return
    start, end = found
    pending = _unfinished_writes(start, end)
    if not pending:
        return
    from syncless.cc import _d2h

    jobs = False
    for entry in pending:
        if entry[0] == "event":
            # staging : [wait E] H2D ...      (E: after the D2H on its stream)
            _gpu_wait(entry[1], staging)
        else:
            # host    : wait for the job (the copy is in host memory), then enqueue the H2D
            _d2h.wait_for_tickets([entry[1]], raise_errors=False)
            jobs = True
    if jobs:
        _unfinished_writes(start, end)  # drops them now that they are done, or raises a failure among them


def _unfinished_writes(start: int, end: int) -> list[tuple]:
    """The entries over ``[start, end)`` still writing; drop the finished ones, and raise the first failed job's
    error if this thread has not had it yet (it then has: its covering waits and ``uninstall()`` do not raise it
    again). A failed job's entry stays while its failure is kept, for the threads that have not had it."""
    failed = None
    pending = []
    with _lock:
        for first in sorted({first for first, _ in _overlapping(start, end)}):
            kept = []
            for item in _by_start[first]:
                entry = item[1]
                if item[0] <= start:  # this entry of the bucket misses the bytes asked about
                    kept.append(item)
                elif entry[0] == "job" and not entry[1][0].is_pending(entry[1][1]) and not _is_done(entry):
                    # Kept while its failure is (until close_d2h_stream or uninstall): each thread that uploads
                    # these bytes without having had it gets it, once; a second failed entry waits for the next.
                    kept.append(item)
                    if failed is None:
                        failed = entry[1][0].claim_failure(entry[1][1])  # None: this thread had it
                elif _is_done(entry):
                    if entry[0] == "event":
                        _recycle(entry)
                else:
                    pending.append(entry)
                    kept.append(item)
            _set_bucket(first, kept)
    if failed is not None:
        raise failed
    return pending


def _gpu_wait(event, stream) -> None:
    """Make ``stream`` wait for ``event`` on the GPU (torch's C method, beneath any patch; never blocks)."""
    import torch

    torch.cuda.Event.__mro__[1].wait(event, stream)


def clear(keep: list | None = None) -> None:
    """Forget every noted write (tests, and a forked child, which passes ``keep``: the entries' events go there,
    never destroyed, as destroying a CUDA event in a forked child aborts it)."""
    global _lock
    if keep is not None:
        _lock = threading.Lock()  # a parent's thread may have held it at the fork
        keep.append((dict(_by_start), {index: list(events) for index, events in _spare_events.items()}))
    with _lock:
        _by_start.clear()
        _starts.clear()
        _longest[0] = 0
        _count[0] = 0
        _trim_at[0] = _TRIM_FLOOR
        _spare_events.clear()


def pending_count() -> int:
    """How many noted writes are kept (tests: the index stays bounded)."""
    return _count[0]

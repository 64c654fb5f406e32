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

import threading
from typing import Any

from syncless.cc import _streams

_lock = threading.Lock()
# Byte ranges of host storages a noted D2H may still be writing: [start, end, entry], where entry is
# ("event", ev) or ("job", ticket). A staged H2D asks only the entries its source overlaps whether they are done
# (and drops those that are); the whole list is trimmed once it reaches _TRIM_AT, so a stream of plain D2H copies
# into pinned memory costs a query per copy only then.
_pending: list[tuple[int, int, tuple]] = []
_TRIM_AT = 64


def _range(t: Any) -> tuple[int, int]:
    """The byte range of ``t``'s whole storage (a write anywhere in it is a conservative overlap)."""
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return start, start + max(storage.nbytes(), 1)


def _is_done(entry: tuple) -> bool:
    if entry[0] == "event":
        import torch

        return torch.cuda.Event.__mro__[1].query(entry[1])  # torch's own query (no D2H marks on this event)
    from syncless.cc import _d2h

    return not _d2h.ticket_pending(entry[1])


def _remember(t: Any, entry: tuple) -> None:
    start, end = _range(t)
    with _lock:
        if len(_pending) >= _TRIM_AT:
            _pending[:] = [item for item in _pending if not _is_done(item[2])]
        _pending.append((start, end, entry))


def note_plain_d2h(dst: Any, stream: Any) -> None:
    """Note a ``non_blocking`` D2H torch just enqueued on ``stream`` into host ``dst`` (GPU-side event record).

    Does nothing for pageable ``dst``. Does not block the host.
    """
    if not dst.is_pinned():
        return
    import torch

    event = torch.cuda.Event()
    _streams.record_event_raw(event, stream)
    _remember(dst, ("event", event))


def note_offloaded_d2h(dst: Any, ticket: Any) -> None:
    """Note offloaded D2H job ``ticket`` (its worker and number) into host ``dst`` (host-only bookkeeping)."""
    _remember(dst, ("job", ticket))


def order_after_pending_writes(staging: Any, src: Any) -> None:
    """Order a copy about to read host ``src`` on ``staging`` after the noted D2H copies still writing it.

    A plain D2H: ``staging`` waits for its event (GPU-side). An offloaded
    one: the host waits for the worker's job (it blocks only in that case).
    """
    if not _pending:
        return
    start, end = _range(src)
    with _lock:
        entries = []
        for item in [item for item in _pending if item[0] < end and start < item[1]]:
            if _is_done(item[2]):
                _pending.remove(item)
            else:
                entries.append(item[2])
    if not entries:
        return
    from syncless.cc import _d2h

    for entry in entries:
        if entry[0] == "event":
            # staging : [wait E] H2D ...      (E: after the D2H on its stream)
            _gpu_wait(entry[1], staging)
        else:
            # host    : wait for the job (the copy is in host memory) ; then enqueue the H2D (a failed job: raise it
            #           here, on the thread that issued it, rather than upload what it never wrote)
            _d2h.wait_for_tickets([entry[1]], raise_errors=True)


def _gpu_wait(event, stream) -> None:
    """Make ``stream`` wait for ``event`` on the GPU (torch's C method, beneath any patch; never blocks)."""
    import torch

    torch.cuda.Event.__mro__[1].wait(event, stream)


def clear() -> None:
    """Forget every noted write (tests)."""
    with _lock:
        _pending.clear()

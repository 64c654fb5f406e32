"""Pinned host memory that a GPU copy may still be writing, so staged H2D copies read it in torch's order.

A staged (or in-place) H2D copy runs on the idle staging stream, which is
ordered after nothing the caller did. That is right for the *device* side
(the destination is new, or written on the current stream afterwards), but
not for the *host* source when a ``non_blocking`` D2H still has to write it::

    torch     S1 : D2H x -> h ........           S0 : [wait S1] H2D h -> y    (reads h after the D2H: correct)
    the shim  S1 : D2H x -> h ........    staging   : H2D h -> tmp            (reads h now: stale)

So every ``non_blocking`` D2H into pinned memory that the shim sees is noted
here under the host storage's address, until it is known finished: a plain
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
_pending: dict[int, list[tuple]] = {}  # host storage address -> [("event", ev) | ("job", seq)]
_PURGE_AT = 256


def _key(t: Any) -> int:
    return t.untyped_storage().data_ptr()


def _is_done(entry: tuple) -> bool:
    if entry[0] == "event":
        import torch

        return torch.cuda.Event.__mro__[1].query(entry[1])  # torch's own query (no D2H marks on this event)
    from syncless.cc._d2h import WORKER

    return not WORKER.is_pending(entry[1])


def _remember(key: int, entry: tuple) -> None:
    with _lock:
        if len(_pending) >= _PURGE_AT:
            for k in [k for k, entries in _pending.items() if all(_is_done(e) for e in entries)]:
                del _pending[k]
        entries = [e for e in _pending.get(key, ()) if not _is_done(e)]
        entries.append(entry)
        _pending[key] = entries


def note_plain_d2h(dst: Any, stream: Any) -> None:
    """Note a ``non_blocking`` D2H torch just enqueued on ``stream`` into host ``dst`` (GPU-side event record).

    Does nothing for pageable ``dst``. Does not block the host.
    """
    if not dst.is_pinned():
        return
    import torch

    event = torch.cuda.Event()
    _streams.record_event_raw(event, stream)
    _remember(_key(dst), ("event", event))


def note_offloaded_d2h(dst: Any, seq: int) -> None:
    """Note offloaded D2H job ``seq`` into host ``dst`` (host-only bookkeeping)."""
    _remember(_key(dst), ("job", seq))


def order_after_pending_writes(staging: Any, src: Any) -> None:
    """Order a copy about to read host ``src`` on ``staging`` after the noted D2H copies still writing it.

    A plain D2H: ``staging`` waits for its event (GPU-side). An offloaded
    one: the host waits for the worker's job (it blocks only in that case).
    """
    if not _pending:
        return
    key = _key(src)
    with _lock:
        entries = [e for e in _pending.get(key, ()) if not _is_done(e)]
        if entries:
            _pending[key] = entries
        else:
            _pending.pop(key, None)
    if not entries:
        return
    import torch

    from syncless.cc._d2h import WORKER

    for entry in entries:
        if entry[0] == "event":
            # staging : [wait E] H2D ...      (E: after the D2H on its stream)
            torch.cuda.Event.__mro__[1].wait(entry[1], staging)
        else:
            # host    : wait for job #seq (the copy is in host memory) ; then enqueue the H2D
            WORKER.wait_for(entry[1])


def clear() -> None:
    """Forget every noted write (tests)."""
    with _lock:
        _pending.clear()

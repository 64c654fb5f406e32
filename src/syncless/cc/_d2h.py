"""D2H streams: copies issued on them return at once and a worker thread performs them.

Timeline of one offloaded copy (``P`` the producer stream, ``D`` the D2H
stream, ``W`` the worker thread)::

    host  : x = f(...) on P ; D.wait_stream(P) ; y = x.to("cpu", non_blocking=True) -> returns now
    P     : [ f ......... ] E                 (E recorded on P when the copy is issued)
    W     :        cuEventSynchronize(E) ...... copy x -> y on W's stream, wait it ; done #n
    later : event.synchronize() / stream.synchronize() / torch.cuda.synchronize() wait for #n too

Why the event goes on ``P`` and not on ``D``: under CC an event behind a
cross-stream wait on an otherwise idle stream can fire a whole step late;
``P`` is the stream whose work the copy really depends on (``D`` waited on
it, and recording on ``P`` later covers at least that much work).
If ``D`` never waited on anything through ``wait_stream``, the event is
recorded on ``D`` itself, so ordering set up with ``D.wait_event`` is
still honoured.

A D2H stream carries copies only: a kernel launched on it is not ordered
before the offloaded copies of its output (the worker waits on ``P``, not
on ``D``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from syncless._core import patching
from syncless._core.errors import SynclessError
from syncless._core.layouts import is_dense_layout
from syncless.cc import _streams
from syncless.cc._layers import SHIM_KEY
from syncless.cc._worker import OrderedWorker

_log = logging.getLogger(__name__)


class D2HStreamCaptureError(SynclessError, RuntimeError):
    """An event was recorded on a D2H stream while a CUDA graph was being captured."""


@dataclass
class _D2HStream:
    stream: Any
    producer: Any = None


_lock = threading.Lock()
_streams_by_key: dict[tuple[int, int], _D2HStream] = {}
WORKER = OrderedWorker("syncless-d2h")


def new_d2h_stream(device: Any = None) -> Any:
    """Create a D2H stream on ``device`` (default: the current GPU).

    The stream is created with ``cuStreamCreate`` outside torch's stream
    pool, so no other code is ever handed the same handle. While the CC shim
    is installed, a ``non_blocking`` device-to-host copy issued with this
    stream current returns at once (see the module docstring). Enqueues
    nothing and does not block the host.

    Ordering back from the D2H stream is host-side only: an offloaded copy
    has not been issued on any GPU stream when the call returns, so
    ``P.wait_stream(d2h)`` or ``P.wait_event(e)`` with ``e`` recorded on it
    does not order ``P`` after the copy. Wait on the host instead
    (``e.synchronize()``, ``d2h.synchronize()``) before a kernel overwrites
    the source or before the pinned result is uploaded again.

    Returns:
        a ``torch.cuda.ExternalStream``; it lives as long as the process.
    """
    index = _streams.device_index(device)
    stream = _streams.create_private_stream(index)
    _streams.worker_stream(index)  # made now, never on the path of a copy
    with _lock:
        _streams_by_key[(index, stream.cuda_stream)] = _D2HStream(stream)
    return stream


def has_streams() -> bool:
    """Return whether any D2H stream exists (the cheap test every patched call makes first)."""
    return bool(_streams_by_key)


def lookup(stream: Any) -> _D2HStream | None:
    """Return the D2H record of ``stream`` (any torch stream object), or None."""
    if not _streams_by_key:
        return None
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        return None
    return _streams_by_key.get((stream.device.index, handle))


def is_d2h_stream(stream: Any) -> bool:
    """Return whether ``stream`` was made by :func:`new_d2h_stream`."""
    return lookup(stream) is not None


def note_wait(waiter: Any, producer: Any) -> None:
    """Remember ``producer`` as the producer of ``waiter`` if ``waiter`` is a D2H stream."""
    record = lookup(waiter)
    if record is None or lookup(producer) is not None:
        return
    import torch

    if not isinstance(producer, torch.cuda.Stream):  # a generic torch.Stream: wrap it so events can be recorded
        producer = torch.cuda.Stream(
            stream_id=producer.stream_id, device_index=producer.device_index, device_type=producer.device_type
        )
    record.producer = producer


def redirect_for_record(stream: Any) -> Any:
    """Return the stream an event meant for ``stream`` must be recorded on.

    A D2H stream's events go to its producer (or stay on it if it has none).

    Raises:
        D2HStreamCaptureError: ``stream`` is a D2H stream and a graph is being captured.
    """
    record = lookup(stream)
    if record is None:
        return stream
    index = stream.device.index
    if _streams.any_current_capture(index) or _streams.is_capturing(stream):
        raise D2HStreamCaptureError(
            f"an event was recorded on the D2H stream {stream} during CUDA graph capture; syncless records such "
            "events on the producer stream outside capture, which a graph cannot replay. Record the event on the "
            "capturing stream instead, or keep D2H streams out of captured regions."
        )
    return record.producer if record.producer is not None else stream


def pinned_like(src: Any, dtype: Any, memory_format: Any) -> Any:
    """Allocate a pinned CPU tensor shaped like ``src`` for a fresh D2H result (host-only, no GPU work)."""
    import torch

    dtype = src.dtype if dtype is None else dtype
    if memory_format is not None and memory_format is not torch.preserve_format:
        return torch.empty(src.shape, dtype=dtype, pin_memory=True).contiguous(memory_format=memory_format)
    if src.is_contiguous() or not is_dense_layout(src.shape, src.stride()):
        return torch.empty(src.shape, dtype=dtype, pin_memory=True)
    return torch.empty_strided(src.shape, src.stride(), dtype=dtype, pin_memory=True)


def offload(record: _D2HStream, dst: Any, src: Any, what: str) -> int:
    """Queue ``dst.copy_(src)`` on the worker, ordered after the producer's work so far.

    Records an event on the producer (GPU-side, no host wait) and returns the
    job's sequence number at once. The job keeps ``src`` and ``dst`` alive
    until the copy has finished.
    """
    import torch

    stream = record.stream
    source_stream = record.producer if record.producer is not None else stream
    ready = torch.cuda.Event()
    torch.cuda.Event.__mro__[1].record(ready, source_stream)
    index = stream.device.index
    # The copy runs on the worker's own stream, not on the D2H stream: the caller's
    # D2H.wait_stream(P) of the *next* step would otherwise sit in front of this copy
    # and hold it until that step's work is done (a whole step late).
    copy_stream = _streams.worker_stream(index)

    def job() -> None:
        nonlocal dst, src
        if torch.cuda.current_device() != index:
            torch.cuda.set_device(index)  # the worker thread's own current device
        _streams.wait_event_raw(ready)
        copy_beneath = patching.beneath(torch.Tensor, "copy_", SHIM_KEY)
        with torch.inference_mode(), torch.cuda.stream(copy_stream):
            copy_beneath(dst, src, non_blocking=True)
            _streams.wait_stream_raw(copy_stream)
        dst = src = None  # release the source only after the copy has run

    return WORKER.submit(job, what)


def drain() -> None:
    """Wait for every queued D2H copy and raise the first failure among them (blocks the host)."""
    WORKER.wait_and_raise(WORKER.submitted)

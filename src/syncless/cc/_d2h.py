"""D2H streams: copies issued on them return at once and a worker thread performs them.

An offloaded copy reads its source as torch would have read it on the D2H
stream ``D`` at the point where it was issued, and everything that torch
would order after it, through the calls syncless sees, waits for it
(``P1``/``P2`` producers, ``W`` the worker's own stream, ``#n`` the job's
number)::

    host : D.wait_stream(P1); D.wait_stream(P2); D.wait_event(e); y.copy_(x, non_blocking=True) -> returns now
    P1   : [ slow write of x ......... ]
    P2   : [ .. ]
    D    : [wait P1][wait P2][wait e] x -> snap R#n  [later kernels on D, e.g. x.zero_()] ...
    W    :                                 (job #n) cuEventSynchronize(R#n) ... copy snap -> y ; wait W ; done

Before the copy: the source is read *on D*, at the call's place in its
queue, into a device snapshot ``snap`` (a device-to-device copy, which CC
leaves asynchronous); ``R#n`` is an event recorded on ``D`` right after it.
So the bytes copied are exactly those torch would have copied there: after
all of ``D``'s queue before the call, whatever put it there (every
``wait_stream``, not only the last; every ``wait_event`` on any event from
any stream, made in Python or in C; copies and kernels the caller ran on
``D``), and before anything queued on ``D`` after it (a kernel that
overwrites the source, a ``zero_()``, the caching allocator handing the
source's block to a new tensor on ``D``). The worker waits for ``R#n`` on
the host and copies ``snap``, which nothing else can write. Nothing about
``D``'s producers is remembered, so there is nothing to forget (issue 14's
stale reads came from remembering only the last ``wait_stream``).

The snapshot costs one device copy of the source and holds its memory
until the worker's copy is done. Without it the worker read the source
itself, and a kernel launched on ``D`` after the copy could overwrite it
first (found in review: torch orders that kernel after the copy). If the
snapshot cannot be allocated, the copy is not offloaded: it runs as torch's
own, blocking under CC, and correct.

After the copy, ordering is host-side, at the calls that order work after
``D`` (:mod:`._sync_patches`, :mod:`._shim`, :mod:`._host_writes`): an event
recorded on any stream after the copy's call carries the last job number of
every D2H stream (:func:`cover_now`, the seed's any-event rule), and waiting
on it (also ``P.wait_stream(S)``, which records one), synchronizing or querying it, or
synchronizing ``D`` or the device first waits for those jobs; a copy between
host and GPU issued while ``D`` is current (not offloaded), and the blocking
reads ``cpu()``/``item()``/``tolist()``, wait for them too; an H2D of host
memory that a pending job writes waits for that job (staged or left to
torch). These host waits happen only where torch itself would have made the
GPU wait for the copy, and never while the worker still needs the caller's
next call (a job depends only on work enqueued before it), so one thread of
one process cannot deadlock on them (several can: docs/cc.md, "Limits"). Each D2H stream has a worker of its own (:class:`_D2HStream`), so a
wait for one stream's jobs never waits for another stream's; synchronizing
an ordinary stream or the device waits for every stream's (docs/cc.md,
"Limits"). What syncless cannot see stays unordered after the copy's write of
the host memory: a kernel launched on ``D`` that reads that host memory
itself (zero-copy access to pinned memory), or a wait through a C-made
``torch.Event`` recorded on ``D`` (``torch.Stream.record_event()``); nor is
anything done through the generic ``torch.Stream`` object of
``D`` (what ``torch.accelerator.current_stream()`` returns while ``D`` is
current): its ``synchronize``, ``query``, ``wait_stream`` and
``record_event`` are C methods the shim does not patch, and
``P.wait_stream(s)`` with such an ``s`` waits through a C-made event
(docs/cc.md, "Limits").

Why no GPU-side gate: an earlier version held ``D`` behind a
``cuStreamWaitValue64`` that the worker released after its copy. That
deadlocked on 2 x H200: streams share a few hardware queues, and once the
worker's stream shared one with a gated ``D``, its copy (issued later)
queued behind the gate it was to open. CUDA orders only what it sees as
events, so a wait on something enqueued later is never safe.

Why the copy runs on ``W`` and not on ``D``: the worker issues it later than
the host did; on ``D`` it would sit behind the caller's next
``D.wait_stream(P)`` and wait a whole step.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import os

from syncless._core import patching
from syncless._core.errors import CudaError, NoGPUError
from syncless.cc import _d2h_job, _helper, _host_writes, _inline_h2d, _raw, _streams, _worker
from syncless.cc._readback_choice import ReadbackChoice
from syncless.cc._layers import SHIM_KEY
from syncless.cc._worker import UNRAISED, OrderedWorker

_log = logging.getLogger(__name__)


@dataclass
class _D2HStream:
    """A D2H stream and its own worker: copies offloaded from it run in its order, independently of other
    D2H streams' (one worker for all made a copy wait behind another stream's copy that waited for a slow
    producer, and could deadlock two host threads)."""

    stream: Any
    last_job: int = 0  # number, on this stream's worker, of the last copy offloaded from it (0: none yet)
    worker: OrderedWorker = field(default_factory=lambda: OrderedWorker("syncless-d2h"))
    closed: bool = False  # set under _offload_lock by close_d2h_stream(): no offload from it any more
    closing: bool = False  # a close_d2h_stream() of it is under way (a second one is refused)
    # The stream its worker copies on, of its own (None: the GPU's shared one, _streams.worker_stream). A shared
    # one made a job's wait for its copy, and under CC the driver's copy itself, wait for other D2H streams' copies.
    copy_stream: Any = None
    # The fast lane's guess whether a small readback finds this stream about to drain (._fast._drains_soon): after a
    # look that timed out, the next ``drain_skips`` readbacks are offloaded without looking; ``drain_misses`` in a
    # row double that number (a loop whose readback waits behind long GPU work stops paying for the look).
    drain_skips: int = 0
    drain_misses: int = 0
    # Where the host waits for a copy (CC, or its emulation): whether a small readback takes the look or goes
    # straight to the offload, chosen by timing the loop both ways now and then (._readback_choice).
    choice: ReadbackChoice = field(default_factory=ReadbackChoice)


# A job of some D2H stream's worker: (worker, number); waiting for it waits for that stream's copies up to it.
Ticket = tuple


_lock = threading.Lock()
# Held from an offload's event record to its submission, so that two host threads offloading from one D2H
# stream number their jobs in the order their ready events sit in its queue.
_offload_lock = threading.Lock()
_streams_by_key: dict[tuple[int, int], _D2HStream] = {}
# Offloaded copies not yet finished, over every D2H stream: the one integer the hot paths read (a blocking copy
# waits for nothing while it is 0). Raised at submission, lowered when the copy has run (or failed).
_PENDING = [0]
_pending_lock = threading.Lock()
# The tickets an event recorded now must cover (the seed's any-event rule, docs/cc.md): the last job of every D2H
# stream's worker that has had one, rebuilt at each submission under _offload_lock from _last_jobs, so that a
# record (which every decode step makes) reads one tuple and builds nothing.
_COVER: list[tuple] = [()]
_last_jobs: dict[OrderedWorker, int] = {}  # worker -> its last job; written under _offload_lock


def pending() -> bool:
    """Whether any offloaded copy, of any D2H stream, has not finished (one integer read, no lock)."""
    return _PENDING[0] > 0


def busy() -> bool:
    """Whether a patched ordering call (an event's record, wait, synchronize or query; a stream's or the device's
    synchronize; a bypassing copy) has anything to cover: an offloaded copy unfinished, or a failure kept.

    While it is False those calls go straight to torch (the patch layer's idle check, :mod:`._sync_patches`).
    Read in this order, as :func:`cover_now` does: a failure is kept before its job counts as finished.
    """
    return bool(_PENDING[0] or UNRAISED[0])


def cover_now() -> tuple:
    """The tickets that an event recorded now covers: every copy offloaded so far, on any D2H stream.

    Empty while no offloaded copy is unfinished and no failure waits to be raised (two integer reads: the cost
    every ``Event.record`` pays while nothing is pending).
    """
    if _PENDING[0] or UNRAISED[0]:
        return _COVER[0]
    return ()


def _rebuild_cover() -> None:
    """Recompute :data:`_COVER` from :data:`_last_jobs` (the caller holds ``_offload_lock``)."""
    _COVER[0] = tuple(_last_jobs.items())


def _records() -> list[_D2HStream]:
    with _lock:
        return list(_streams_by_key.values())


def all_tickets() -> list[Ticket]:
    """The last job of every D2H stream's worker now: waiting for all of them covers every copy offloaded so far.

    Every ``torch.cuda.synchronize()`` and ordinary stream's ``synchronize()`` asks this: one tuple read.
    """
    return list(_COVER[0])


def wait_for_tickets(tickets: list[Ticket], *, raise_errors: bool, timeout_s: float | None = None,
                     any_thread: bool = False) -> None:
    """Block the host until each ticket's copies have finished (at most ``timeout_s`` in all); with
    ``raise_errors``, then raise the failures among them that this thread has not had yet (``any_thread``: any),
    in one ``D2HCopyError``.

    A failure on one stream does not cut the wait for the others short: the caller may handle the error and read
    another stream's result, which torch's synchronize would have waited for.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for worker, seq in tickets:
        if worker.is_pending(seq):
            worker.wait_for(seq, timeout_s=None if deadline is None else max(0.0, deadline - time.monotonic()))
    if not raise_errors:
        return
    # Raised only once every wait is over: a failure is marked had as it is taken, so one taken before a wait
    # that an interrupt then ends would be lost (had, never raised).
    failed: list[_worker.D2HCopyError] = []
    for worker, seq in tickets:
        try:
            worker.wait_and_raise(seq, any_thread=any_thread)  # finished: waits for nothing
        except _worker.D2HCopyError as err:
            failed.append(err)
    if failed:
        raise _together(failed)


def _together(errors: list[_worker.D2HCopyError]) -> _worker.D2HCopyError:
    """One error for the failures of several D2H streams that one call covered: the first in full, the others'
    headlines after it (each stream's error already counts those it covered)."""
    if len(errors) == 1:
        return errors[0]
    first = errors[0]
    others = "; ".join(err.message for err in errors[1:])
    joined = _worker.D2HCopyError(f"{first.message}; also covered by this call, on other D2H streams: {others}",
                                  first.worker_traceback)
    joined.__cause__ = first.__cause__
    joined.__suppress_context__ = True
    return joined


def ticket_pending(ticket: Ticket | None) -> bool:
    return ticket is not None and ticket[0].is_pending(ticket[1])


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError(
            "syncless.cc.new_d2h_stream() needs a CUDA GPU, but torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda}); run on a machine with an NVIDIA GPU and a "
            "CUDA build of torch, or keep D2H copies on an ordinary stream"
        )


def new_d2h_stream(device: Any = None) -> Any:
    """Create a D2H stream on ``device`` (default: the current GPU).

    The stream is created with ``cuStreamCreate`` outside torch's stream
    pool, so no other code is ever handed the same handle. While the CC shim
    is installed, a ``non_blocking`` device-to-host copy issued with this
    stream current returns at once and the worker thread performs it; it is
    ordered exactly as if torch had run it on this stream (see the module
    docstring), both before (everything the stream waited for) and after
    (everything that waits for it through an event, ``wait_stream`` or a
    synchronize, and any other copy issued on it; not a kernel launched on
    it). Enqueues nothing and does not block the host.

    Returns:
        a ``torch.cuda.ExternalStream``. It keeps a CUDA stream (two: its own
        and its worker's copy stream), a retain of the device's primary
        context, a worker thread (from its first offloaded copy) and an atexit
        entry. :func:`close_d2h_stream` ends the thread and the entry and
        gives the streams back for the next ``new_d2h_stream()`` to reuse.

    Raises:
        NoGPUError: torch has no usable CUDA GPU (a ``MissingDependencyError`` and a ``RuntimeError``).
    """
    _require_cuda()
    index = _streams.device_index(device)
    with _lock:
        released = _released_pairs.get(index)
        pair = released.pop() if released else None
    if pair is None:
        pair = (_streams.create_private_stream(index),
                _streams.create_private_stream(index))  # the copy stream: made now, never on the path of a copy
    stream, copy_stream = pair
    with _lock:
        _streams_by_key[(index, stream.cuda_stream)] = _D2HStream(stream, copy_stream=copy_stream)
    if _helper.ENABLED[0]:
        _helper.start(index)  # SYNCLESS_CC_D2H_HELPER: start the GPU's helper now (it is ready well before a step)
    return stream


# Streams given back by close_d2h_stream(), per GPU, for the next new_d2h_stream() to reuse. A CUDA stream is
# never destroyed: torch's allocators keep the streams a block was used on (the pinned host allocator records an
# event on each when the block is freed, which may be long after the close), and an event recorded on a
# destroyed stream fails inside a destructor, which aborts the process (seen on the H200). Reuse bounds what a
# stream per request holds by the most streams open at once.
_released_pairs: dict[int, list[tuple[Any, Any]]] = {}


def close_d2h_stream(stream: Any, timeout_s: float = 60.0) -> None:
    """Release a stream made by :func:`new_d2h_stream`: wait for its offloaded copies, end its worker, pool it.

    Blocks the host until the copies offloaded from ``stream`` have finished
    (at most ``timeout_s``). From the call on, a copy issued on ``stream`` is
    not offloaded; after it returns, ``stream`` must not be used again (a
    later :func:`new_d2h_stream` on its GPU reuses its CUDA stream). Ends its
    worker thread and drops its atexit entry (issue 27 item 8); the CUDA
    stream and its context retain are kept for reuse, never destroyed, since
    torch's allocators may still record events on it.

    Raises:
        ValueError: ``stream`` is not an open D2H stream, or it is the current stream of its GPU.
        TypeError: ``timeout_s`` is not a number.
        D2HCopyError: one of its copies failed (raised after releasing, whichever thread issued it).
        D2HTimeoutError: they did not finish in time (the stream is then left open).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"close_d2h_stream(timeout_s=...) must be a number of seconds, got {timeout_s!r}")
    record = lookup(stream)
    if record is None:
        raise ValueError(f"close_d2h_stream: {stream!r} is not an open stream from syncless.cc.new_d2h_stream()")
    index = stream.device.index
    if getattr(_streams.current_stream(index), "cuda_stream", None) == stream.cuda_stream:
        raise ValueError(f"close_d2h_stream: {stream!r} is the current stream of cuda:{index}; leave its "
                         "`with torch.cuda.stream(...)` block first")
    with _offload_lock:
        # One close at a time: two that both went on pooled the same CUDA stream twice, so the next two
        # new_d2h_stream() calls returned one stream (issue 33 item 5).
        if record.closing or _streams_by_key.get((index, stream.cuda_stream)) is not record:
            raise ValueError(f"close_d2h_stream: {stream!r} is already being closed by another call")
        record.closing = record.closed = True  # an offload from it that has not submitted yet runs torch's own
    try:
        record.worker.wait_for(record.last_job, timeout_s=timeout_s)
    except BaseException:
        with _offload_lock:
            record.closing = record.closed = False
        raise
    with _lock:
        _streams_by_key.pop((index, stream.cuda_stream), None)
    with _offload_lock:
        _last_jobs.pop(record.worker, None)
        _rebuild_cover()
    unreported = record.worker.take_unreported()  # whichever thread issued them; forgotten with the stream
    record.worker.shutdown(timeout_s)
    atexit.unregister(record.worker.shutdown)
    if record.copy_stream is not None:  # its last copy was waited for above; the pair is reused as a whole
        with _lock:
            _released_pairs.setdefault(index, []).append((stream, record.copy_stream))
    if unreported:
        raise _worker.error_for(unreported)


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


def pinned_like(src: Any, dtype: Any, memory_format: Any) -> Any:
    """Allocate the pinned CPU tensor torch's ``src.to("cpu", dtype, memory_format=..., non_blocking=True)`` returns.

    Host-only, no GPU work. Its dtype, shape and strides are those torch's
    own copy gives (read from the same call on the meta device, which follows
    the same rules: the source's strides for a dense source, dense strides in
    the source's order otherwise, or the asked memory format), and it is
    pinned, as torch's non_blocking result is.
    """
    import torch

    if src.is_contiguous() and (memory_format is None or memory_format is torch.preserve_format):
        return pinned_block(src, src.dtype if dtype is None else dtype)
    dtype = src.dtype if dtype is None else dtype
    fmt = torch.preserve_format if memory_format is None else memory_format
    layout = patching.beneath(torch.Tensor, "to", SHIM_KEY)(src, device="meta", dtype=dtype, memory_format=fmt)
    return torch.empty_strided(layout.shape, layout.stride(), dtype=dtype, pin_memory=True)


def pinned_block(src: Any, dtype: Any) -> Any:
    """The pinned result of torch's ``src.to("cpu", dtype, non_blocking=True)`` for a contiguous ``src``: its shape
    and strides exactly (torch keeps a dense source's strides, a size-1 dim's odd stride included). Host only."""
    import torch

    return torch.empty_strided(src.shape, src.stride(), dtype=dtype, pin_memory=True)


# Set under _offload_lock when uninstall() begins, and cleared only by the next install(): no offload may slip in
# behind the drain, nor after the patched syncs are gone (issue 27 item 3: a thread still inside a wrapper, blocked
# in the pinned allocation, used to submit a job once uninstall() had cleared the flag again, which no patched
# synchronize then covered).
_CLOSING = [False]


def stop_offloading() -> None:
    """From now on :func:`offload` declines (returns 0): the caller runs torch's own copy. For ``uninstall()``."""
    with _offload_lock:
        _CLOSING[0] = True


def resume_offloading() -> None:
    """Undo :func:`stop_offloading`: for ``install()``, once the patched synchronizes are in place."""
    with _offload_lock:
        _CLOSING[0] = False


def offload(record: _D2HStream, dst: Any, src: Any, verb: str, *, into_existing: bool) -> int:
    """Queue ``dst.copy_(src)`` as a job of ``record``'s queue, reading ``src`` as the D2H stream would now.

    Enqueues on the D2H stream (current) a device copy of ``src`` and one
    event record after it (see the module docstring), and returns the job's
    number at once; the host does not block. ``into_existing``: ``dst`` is
    the caller's tensor (a ``copy_``), whose version counter is bumped once
    now, as torch's copy bumps it; a fresh ``.to()`` result keeps version 0,
    as torch's does. Returns 0, having queued nothing that matters (at most a
    device copy nobody reads), when the device has no room for the snapshot
    or offloading is closed: the caller then runs torch's own copy instead.
    """
    import torch

    if _CLOSING[0]:
        return 0
    stream = record.stream
    try:
        snap = _d2h_job.snapshot(src, dst, stream)
    except torch.OutOfMemoryError:
        _warn_no_room(src)
        return 0
    return _queue(record, dst, snap, src, verb, into_existing, stream.device.index)


def offload_block(record: _D2HStream, dst: Any, src: Any, index: int) -> int:
    """:func:`offload` of ``src.to("cpu", non_blocking=True)`` into the fresh pinned ``dst`` (the shim's fast lane).

    ``src`` is one contiguous block on GPU ``index`` (the current device) with ``dst``'s dtype, shape and strides,
    no conjugate or negative bit (:mod:`._fast` checked): its snapshot is one raw device copy. Same stream ordering
    and return value as :func:`offload`; does not block the host.
    """
    import torch

    if _CLOSING[0]:
        return 0
    try:
        snap = _d2h_job.snapshot_block(src, record.stream, index)
    except torch.OutOfMemoryError:
        _warn_no_room(src)
        return 0
    return _queue(record, dst, snap, src, ".to('cpu', non_blocking=True)", False, index)


def offload_to_helper(record: _D2HStream, src: Any, index: int, helper: Any) -> Any:
    """``src.to("cpu", non_blocking=True)`` offloaded to GPU ``index``'s D2H helper process; the pinned result, or
    None (no free slot, or offloading is closed: the caller offloads in this process, or runs torch's own copy).

    ``src``: one contiguous block of at most ``helper.slot_bytes`` on GPU ``index`` (current), as for
    :func:`offload_block`. Enqueues on the D2H stream ``D``, in its order (so the bytes are those torch's copy would
    read there), the slot's snapshot and its ready event, then posts the copy to the helper and queues the job that
    delivers it::

        D      : ...everything D was ordered after... src -> ring[slot]  R[slot] ...
        helper :                         (R[slot] fired) ring[slot] -> staging[slot] ; done[slot] = hseq
        waiter :                         (job #n, at a covering wait) done? -> memmove staging[slot] -> dst

    All under ``_offload_lock``: the slot's write, its record and its post are one step that a capture, a close or
    ``uninstall()`` either precede (then nothing is enqueued) or follow (then the job is queued and covered); and
    a slot with a write enqueued is never handed back unposted (a later snapshot into it could race that write).
    The job counts as finished after the ``memmove``; every ordering after it is :func:`_queue`'s. Does not block
    the host.
    """
    dst = pinned_block(src, src.dtype)
    with _offload_lock:
        if (_CLOSING[0] or record.closed or not record.worker.accepting or _streams.CAPTURES[0]
                or not helper.usable):  # (a helper stopped by an uninstall() since the caller looked it up)
            return None
        try:
            slot = helper.free.pop()
        except IndexError:
            return None  # every slot holds a copy not yet delivered
        nbytes = src.nbytes
        try:
            # D : ... src -> ring[slot]  R[slot]   (one context check for both enqueues)
            _raw.snapshot_and_record(index, helper.ring + slot * helper.slot_bytes, src.data_ptr(), nbytes,
                                     record.stream, helper.events[slot])
        except CudaError as err:
            if err.call == "cuMemcpyDtoDAsync":
                helper.free.append(slot)  # the copy was not enqueued: the slot holds no write
            raise  # (a failed record keeps the slot out: its write is queued)
        job = _d2h_job.HelperJob(helper, slot, helper.post(slot, nbytes), dst, nbytes)
        job.settled = _settled
        seq = _submit_locked(record, job, False)
    _host_writes.note_offloaded_d2h(dst, (record.worker, seq))
    return dst


def _warn_no_room(src: Any) -> None:
    _log.warning("syncless.cc: no GPU memory for a %d-byte snapshot of an offloaded D2H copy; it runs as "
                 "torch's own copy (blocking under CC)", src.numel() * src.element_size())


def _queue(record: _D2HStream, dst: Any, snap: Any, src: Any, verb: str, into_existing: bool, index: int) -> int:
    """Record the ready event after ``snap`` on the D2H stream and queue the job that copies it into ``dst``."""
    stream = record.stream
    ready = _raw.take_ready_event(index)
    copy_stream = record.copy_stream if record.copy_stream is not None else _streams.worker_stream(index)
    job = _d2h_job.CopyJob(index, ready, dst, snap, copy_stream, verb, src)
    job.settled = _settled
    del snap  # the job holds it until its copy has run
    with _offload_lock:
        # uninstall() began after the check above, or the worker was shut down at interpreter exit (an atexit
        # handler registered before the worker's runs after its shutdown, issue 27 item 5), or a CUDA graph capture
        # began on some thread (its capture_begin drains what was queued before): torch's own copy
        if _CLOSING[0] or record.closed or not record.worker.accepting or _streams.CAPTURES[0]:
            _raw.give_back_ready_event(index, ready)
            return 0
        # D : ...everything D was ordered after... src -> snap R#n ...
        _raw.record_ready(ready, stream)
        seq = _submit_locked(record, job, job.nbytes >= _d2h_job.EAGER_BYTES)
    if into_existing:
        _bump_version(dst)  # as torch's copy does, at the call
    _host_writes.note_offloaded_d2h(dst, (record.worker, seq))  # a staged H2D of dst waits for it
    return seq


def _submit_locked(record: _D2HStream, job: Any, eager: bool) -> int:
    """Count ``job`` pending, queue it on ``record``'s worker and make it the stream's last job and part of the
    cover, before the offloading call returns (any event recorded after it covers this job); its number. The
    caller holds ``_offload_lock`` and has enqueued the job's ready event on the D2H stream.

    An interrupt (a ``KeyboardInterrupt``), wherever it comes, leaves the job either queued, counted and covered,
    or none of the three, and is raised on.
    """
    worker = record.worker
    # The job's number, known before it is queued: every job of a D2H stream's worker is submitted here, under
    # _offload_lock, so none comes in between. Whether it was queued is read from the worker's count afterwards,
    # not from submit() returning: an interrupt raised as submit() returns (where Python runs a pending signal
    # handler), or one in the Thread.start() of its first job, leaves the job queued without the return value, and
    # counting it as never submitted made _PENDING end at -1 once it ran (the blocking reads then skipped a copy).
    # (``_submitted``, not the ``submitted`` property: a property is a call, which an interrupt can come out of.)
    seq = worker._submitted + 1
    previous = _last_jobs.get(worker)
    counted = False
    try:
        _last_jobs[worker] = seq
        cover = tuple(_last_jobs.items())  # built before the job is queued: once it is, only plain stores are left
        with _pending_lock:
            _PENDING[0] += 1
            counted = True
        worker.submit(job, eager=eager)
    finally:
        if worker._submitted >= seq:  # queued (submit() counts and queues a job in one step)
            record.last_job = seq
            _COVER[0] = cover
        else:
            if previous is None:
                _last_jobs.pop(worker, None)
            else:
                _last_jobs[worker] = previous
            if counted:
                with _pending_lock:
                    _PENDING[0] -= 1
    return seq


def _settled() -> None:
    """A job's end is on record (a failure included): one copy fewer is unfinished.

    Called by the queue under its lock, not from a ``finally`` of the job: between a failed job's end and the
    record of its failure, a lowered count would make an event recorded then cover nothing and its synchronize
    report all clear.
    """
    with _pending_lock:
        _PENDING[0] -= 1


def _bump_version(dst: Any) -> None:
    import torch

    increment = getattr(torch.autograd.graph, "increment_version", None)
    if increment is not None:
        increment(dst)


def wait_for_stream(record: _D2HStream) -> None:
    """Block the host until every copy offloaded so far from ``record``'s stream has finished.

    Raises:
        D2HCopyError: one of them, issued by this thread, failed (docs/cc.md: at the next covering call).
    """
    record.worker.wait_and_raise(record.last_job)


def begin_capture(graph: Any, global_mode: bool = True) -> None:
    """Before ``graph`` begins a CUDA graph capture (in torch's global mode or not): refuse new offloads, then wait
    for every queued copy.

    Under ``_offload_lock``, so every offload either was submitted before (and is waited for here) or sees the
    capture and declines. Blocks the host until those copies are done (as ``torch.cuda.graph``'s own synchronize
    does); a failure among them that this thread has not had yet is raised. Whatever the mode: in a thread_local
    one a job run by the capturing thread (a covering wait helps run it) would make a call that mode forbids.
    """
    with _offload_lock:
        _streams.note_capture(graph, True, global_mode)
    try:
        wait_for_tickets(all_tickets(), raise_errors=True)
    except BaseException:
        _streams.note_capture(graph, False)
        raise


def drain(timeout_s: float | None = None) -> None:
    """Wait for every queued D2H copy of every D2H stream (blocks the host, at most ``timeout_s``); then raise, in
    one error, every failure of any stream whose issuing thread never had it, and forget them all.

    Raises:
        D2HCopyError: copies failed (``uninstall()``: one error for every stream's, issue 33 item 4; before, the
            other streams' stayed queued and a thread's synchronize after a re-install raised them).
        D2HTimeoutError: ``timeout_s`` passed first.
    """
    wait_for_tickets(all_tickets(), raise_errors=False, timeout_s=timeout_s)
    unreported = []
    for record in _records():
        unreported += record.worker.take_unreported()
    if unreported:
        raise _worker.error_for(sorted(unreported, key=lambda failure: failure.seq))


def restart_workers() -> None:
    """Let every D2H stream's worker accept copies again after a shutdown (re-install)."""
    for record in _records():
        record.worker.restart()


def _forget_after_fork() -> None:
    """In a forked child: nothing offloaded in the parent is pending here (no worker thread, no CUDA context).

    The child inherits the parent's counts, but neither its threads nor a usable CUDA context: with the count of
    pending copies above 0, its ``torch.as_tensor`` (a DataLoader worker collating numpy arrays) asked CUDA for the
    current stream (issue 33 item 6). Every lock is made anew, as one may have been held by a parent's thread.
    What the parent's copies hold (device snapshots, events, streams) is kept, never released: freeing CUDA memory
    or destroying an event in a forked child calls into CUDA, which aborts it (found on the H200: a DataLoader
    worker killed by SIGABRT).
    """
    global _lock, _offload_lock, _pending_lock
    _lock, _offload_lock, _pending_lock = threading.Lock(), threading.Lock(), threading.Lock()
    for record in _streams_by_key.values():
        record.worker.forget_after_fork(_FORK_LEFTOVERS)
    _FORK_LEFTOVERS.append((list(_streams_by_key.values()), dict(_released_pairs)))
    _streams_by_key.clear()
    _released_pairs.clear()
    _last_jobs.clear()
    _COVER[0] = ()
    _PENDING[0] = 0
    _worker.forget_unraised_after_fork()
    _raw.forget_after_fork()
    _inline_h2d.forget_after_fork()
    _streams.forget_after_fork()
    _helper.forget_after_fork()
    _host_writes.clear(keep=_FORK_LEFTOVERS)


# In a forked child: what the parent's copies held, kept alive for the child's life (see _forget_after_fork).
_FORK_LEFTOVERS: list = []

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)

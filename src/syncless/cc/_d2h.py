"""D2H streams: copies issued on them return at once and a worker thread performs them.

An offloaded copy behaves as if torch had run it on the D2H stream ``D`` at
the point where it was issued: it reads its source after everything ``D``
was ordered after, and everything ordered after that point on ``D`` (later
work on ``D``, and any stream or host that waits for ``D``) comes after the
copy. Two GPU-side marks on ``D`` do this, enqueued under one lock, in job
order (``P1``/``P2`` producers, ``W`` the worker's own stream, ``#n`` the
job's number)::

    host : D.wait_stream(P1); D.wait_stream(P2); D.wait_event(e); y.copy_(x, non_blocking=True) -> returns now
    P1   : [ slow write of x ......... ]
    P2   : [ .. ]
    D    : [wait P1][wait P2][wait e] R#n [GATE: flag >= n] later work on D, waiters of D ...
    W    :                           (worker) cuEventSynchronize(R#n) ... copy x -> y ; flag := n
                                                                                   ^ releases the GATE

1. ``R#n``, an event recorded *on D itself*: it fires only when all of
   ``D``'s queue before it is done, whatever put it there: every
   ``wait_stream`` (not only the last), every ``wait_event`` (on an event
   from any stream, torch.cuda.Event or torch.Event, made in Python or in C),
   kernels and copies the caller ran on ``D``, the shim's own H2D ordering.
   The worker waits for ``R#n`` (on the host) before it copies, so the copy
   never reads its source early. Nothing about ``D``'s producers is
   remembered, so there is nothing to forget.
2. ``GATE#n``, a ``cuStreamWaitValue64(flag >= n)`` on ``D``, released by the
   worker's ``cuStreamWriteValue64(flag := n)`` on ``W`` after the copy (and
   also if the copy failed, so ``D`` never hangs). Later work on ``D`` (a
   kernel overwriting the source), ``P.wait_stream(D)``, ``P.wait_event(e)``
   with ``e`` recorded on ``D``, ``D.synchronize()``, ``torch.cuda.synchronize()``
   (even a reference taken before ``install()``): all are ordered after the
   copy on the GPU, as they would be had torch made the copy on ``D``.

Why no deadlock: jobs run in number order, and ``R#n`` can only depend
(through ``D``'s queue and any chain of cross-stream waits) on work enqueued
before it on the host, so on gates ``#m`` with ``m < n``, all enqueued before
it under the same lock; by the time the worker waits for ``R#n``, jobs
``m < n`` have written their flags.

Why the copy runs on ``W`` and not on ``D``: the worker issues it later than
the host did; on ``D`` it would sit behind the caller's next
``D.wait_stream(P)`` and wait a whole step.

Why ``R#n`` is no longer recorded on "the producer": an earlier design
recorded it on the stream ``D`` last waited on (an event behind a
cross-stream wait on an idle stream was said to fire late under CC). That
is exact only when ``D``'s queue since the previous copy holds that one wait
and nothing else, which syncless cannot see (a kernel on ``D`` or a C-made
event wait is invisible to it); with two producers, or a ``wait_event``, it
read stale data. Correctness first: ``R#n`` goes on ``D``. If an event on
``D`` does fire late under real CC, the copy is late, never stale
(docs/cc.md lists this among the figures to measure).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from syncless._core import patching
from syncless._core.errors import MissingDependencyError
from syncless._core.layouts import is_dense_layout
from syncless.cc import _host_writes, _streams
from syncless.cc._layers import SHIM_KEY
from syncless.cc._worker import OrderedWorker

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _D2HStream:
    stream: Any
    gate_address: int  # the device's gate flag (see _streams.gate_flag)


_lock = threading.Lock()
# Held from an offload's event record to its gate, so that records and gates are enqueued in job-number order
# across host threads (the no-deadlock argument in the module docstring needs it).
_offload_lock = threading.Lock()
_streams_by_key: dict[tuple[int, int], _D2HStream] = {}
WORKER = OrderedWorker("syncless-d2h")


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise MissingDependencyError(
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
    (later work on the stream and everything that waits for it, on the GPU
    and on the host). Enqueues nothing on the new stream; blocks the host
    once per device, the first time, to zero the gate flag.

    Returns:
        a ``torch.cuda.ExternalStream``; it lives as long as the process.

    Raises:
        MissingDependencyError: torch has no usable CUDA GPU.
        SynclessError: the GPU cannot wait on 64-bit flags from a stream.
    """
    _require_cuda()
    index = _streams.device_index(device)
    _, gate_address = _streams.gate_flag(index)
    stream = _streams.create_private_stream(index)
    _streams.worker_stream(index)  # made now, never on the path of a copy
    with _lock:
        _streams_by_key[(index, stream.cuda_stream)] = _D2HStream(stream, gate_address)
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


def pinned_like(src: Any, dtype: Any, memory_format: Any) -> Any:
    """Allocate a pinned CPU tensor shaped like ``src`` for a fresh D2H result (host-only, no GPU work)."""
    import torch

    dtype = src.dtype if dtype is None else dtype
    if memory_format is not None and memory_format is not torch.preserve_format:
        return torch.empty(src.shape, dtype=dtype, pin_memory=True).contiguous(memory_format=memory_format)
    if src.is_contiguous() or not is_dense_layout(src.shape, src.stride()):
        return torch.empty(src.shape, dtype=dtype, pin_memory=True)
    return torch.empty_strided(src.shape, src.stride(), dtype=dtype, pin_memory=True)


def make_job(index: int, ready: Any, gate_address: int, dst: Any, src: Any):
    """Return ``job(seq)``: wait for ``ready``, copy ``src`` into ``dst`` on the worker stream, release gate ``seq``.

    Runs on the worker thread. It blocks that thread (never the caller's)
    until ``ready`` fires and then until the copy and the flag write are
    done. The flag is written even when the copy fails, so work held behind
    the gate on the D2H stream never hangs; the failure is raised by the next
    synchronize that covers the job. ``src`` and ``dst`` stay alive until the
    copy has run.
    """
    import torch

    copy_stream = _streams.worker_stream(index)

    def job(seq: int) -> None:
        nonlocal dst, src
        try:
            if torch.cuda.current_device() != index:
                torch.cuda.set_device(index)  # the worker thread's own current device
            _streams.wait_event_raw(ready)
            copy_beneath = patching.beneath(torch.Tensor, "copy_", SHIM_KEY)
            with torch.inference_mode(), torch.cuda.stream(copy_stream):
                copy_beneath(dst, src, non_blocking=True)
        finally:
            # W : copy #seq  flag := seq     (after the copy on W; releases GATE#seq on the D2H stream)
            _streams.write_flag(copy_stream, gate_address, seq)
            _streams.wait_stream_raw(copy_stream)
            dst = src = None  # release the source only after the copy has run

    return job


def offload(record: _D2HStream, dst: Any, src: Any, what: str) -> int:
    """Queue ``dst.copy_(src)`` on the worker, ordered as if it ran on the D2H stream now.

    Enqueues two GPU-side marks on the D2H stream (the ready event, then the
    gate; see the module docstring) and returns the job's number at once;
    the host does not block.
    """
    import torch

    stream = record.stream
    index = stream.device.index
    ready = torch.cuda.Event()
    with _offload_lock:
        # D : ...everything D was ordered after... R#n [GATE flag >= n] ...later work on D...
        _streams.record_event_raw(ready, stream)
        seq = WORKER.submit_numbered(lambda n: _bind(make_job(index, ready, record.gate_address, dst, src), n), what)
        _streams.wait_flag_geq(stream, record.gate_address, seq)
    _host_writes.note_offloaded_d2h(dst, index, record.gate_address, seq)  # a staged H2D of dst waits for it
    return seq


def _bind(job, seq: int):
    return lambda: job(seq)


def drain() -> None:
    """Wait for every queued D2H copy and raise the first failure among them (blocks the host)."""
    WORKER.wait_and_raise(WORKER.submitted)

"""Thin CUDA driver calls for the copy-engine transport (through :mod:`syncless._core.cuda`).

Every resource made here is counted in :func:`live_resources` until it is
released, so tests can check that a failed or closed transport left nothing
allocated, mapped or created. Device pointers and stream handles are plain
ints (``torch.cuda.Stream.cuda_stream`` is one); cuda-bindings accepts them.
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter
from typing import Any

from syncless._core import cuda
from syncless._core.errors import CudaError

#: Written into a flag from the host side to release every wait on it (cyclic
#: ``>=`` with any step number below 2**62 holds).
RELEASE_VALUE = 1 << 62

IPC_HANDLE_NBYTES = 64

_live: Counter[str] = Counter()
_live_lock = threading.Lock()


def _count(kind: str, delta: int) -> None:
    with _live_lock:
        _live[kind] += delta


def live_resources() -> dict[str, int]:
    """Return how many allocations, IPC mappings, streams, events and contexts are held now."""
    with _live_lock:
        return {kind: n for kind, n in _live.items() if n}


def _drv() -> Any:
    return cuda.ensure_driver()


class PrimaryContext:
    """The primary context of one GPU (the one torch uses), retained while the transport lives.

    ``with ctx:`` makes it current on this thread and restores the previous
    one afterwards, so the caller's own CUDA state is untouched.
    """

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.device = cuda.call("cuDeviceGet", ordinal)
        self.handle = cuda.call("cuDevicePrimaryCtxRetain", self.device)
        _count("context", 1)

    def __enter__(self) -> PrimaryContext:
        cuda.call("cuCtxPushCurrent", self.handle)
        return self

    def __exit__(self, *exc: object) -> None:
        cuda.call("cuCtxPopCurrent")

    def make_current(self) -> None:
        """Bind this context to the calling thread (for threads that syncless owns)."""
        cuda.call("cuCtxSetCurrent", self.handle)

    def release(self) -> None:
        """Drop the retain taken in ``__init__``."""
        cuda.call("cuDevicePrimaryCtxRelease", self.device)
        _count("context", -1)


class ThreadBinding:
    """Makes a primary context current for one call at the lowest host cost; one per transport.

    The per-step driver calls need the transport's primary context current
    (the CUDA docs only promise that for calls naming a stream of that
    context when it is current, so we never rely on less). Pushing and
    popping it costs two driver calls per step, yet on a thread that torch
    already uses for this GPU it is current anyway. So:

    - :meth:`enter` asks torch for the thread's current device (cheap). Not
      ours: push the context (``exit`` pops it), as before.
    - Ours: once per thread, ask the driver what is current
      (``cuCtxGetCurrent``). Our primary context: remember that on this
      thread (a ``threading.local`` of this object) and from then on trust
      torch's answer. No context at all: make ours current with
      ``cuCtxSetCurrent``, which is what the CUDA runtime itself does on the
      thread's first call for that device, and remember it. Another context
      of our GPU (one the caller created with the driver API): push ours
      each call, never remembered.

    The runtime's current device follows the driver's current context, so a
    later ``torch.cuda.set_device`` (or any switch to another GPU's context)
    shows in torch's answer and sends the call back to the push path. The one
    switch it cannot see is the caller making a *non-primary* context of this
    same GPU current after we checked; a driver call then fails loudly
    (CudaError), it does not run elsewhere.

    Args:
        ordinal: the GPU.
        handle: the primary context (as returned by the driver).
        current_device: returns the thread's current device ordinal (torch's).
        get_current, set_current, push, pop: the driver calls, already checked
            (``get_current`` returns a context handle; ``int()`` of it is 0 for none).
    """

    def __init__(self, ordinal: int, handle: Any, current_device: Any, get_current: Any, set_current: Any,
                 push: Any, pop: Any):
        self.ordinal = ordinal
        self.handle = handle
        self._handle_int = int(handle)
        self._current_device = current_device
        self._get_current = get_current
        self._set_current = set_current
        self._push = push
        self._pop = pop
        self._local = threading.local()

    def enter(self) -> bool:
        """Make the context current for this call; return whether :meth:`exit` must pop it."""
        if self._current_device() == self.ordinal:
            if getattr(self._local, "bound", False):
                return False
            current = int(self._get_current())
            if current == self._handle_int:
                self._local.bound = True
                return False
            if current == 0:
                self._set_current(self.handle)
                self._local.bound = True
                return False
        self._push(self.handle)
        return True

    def exit(self, pushed: bool) -> None:
        """Undo :meth:`enter` (pop only what it pushed)."""
        if pushed:
            self._pop()

    def forget(self) -> None:
        """Drop this thread's memory (the next :meth:`enter` asks the driver again)."""
        self._local.bound = False


def thread_binding(ctx: PrimaryContext) -> ThreadBinding:
    """Return a :class:`ThreadBinding` for ``ctx`` over torch and the real driver."""
    import torch

    return ThreadBinding(
        ctx.ordinal,
        ctx.handle,
        torch.cuda.current_device,
        lambda: cuda.call("cuCtxGetCurrent"),
        lambda handle: cuda.call("cuCtxSetCurrent", handle),
        lambda handle: cuda.call("cuCtxPushCurrent", handle),
        lambda: cuda.call("cuCtxPopCurrent"),
    )


class Hot:
    """The per-step driver calls, bound once: no name lookups, flags resolved, results checked inline.

    Each method enqueues on the stream it is given and does not block the
    host; a failing call raises :class:`~syncless._core.errors.CudaError`
    through :func:`syncless._core.cuda.check`, exactly like ``cuda.call``.
    """

    __slots__ = ("_ok", "_memcpy", "_record", "_wait_event", "_wait_value", "_write_value", "_geq", "_write_default",
                 "_batch", "_batch_attrs", "_pointer")

    def __init__(self, batch: bool = False) -> None:
        """``batch``: issue several copies as one ``cuMemcpyBatchAsync`` (where :func:`batch_copy_problem` agreed)."""
        drv = cuda.ensure_driver()
        self._ok = drv.CUresult.CUDA_SUCCESS
        self._memcpy = drv.cuMemcpyAsync
        self._batch = drv.cuMemcpyBatchAsync if batch else None
        self._batch_attrs = [_copy_engine_attributes(drv)] if batch else []
        self._pointer = drv.CUdeviceptr if batch else None
        self._record = drv.cuEventRecord
        self._wait_event = drv.cuStreamWaitEvent
        self._wait_value = drv.cuStreamWaitValue64
        self._write_value = drv.cuStreamWriteValue64
        self._geq = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self._write_default = int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Enqueue a copy of ``nbytes`` (peer or local, inferred from the addresses) on ``stream``."""
        result = self._memcpy(dst, src, nbytes, stream)
        if result[0] != self._ok:
            cuda.check("cuMemcpyAsync", result)

    def memcpy_all(self, copies: list[tuple[int, int, int]], stream: int) -> None:
        """Enqueue every ``(dst, src, nbytes)`` copy on ``stream``, as one batched operation where enabled.

        The copies must not overlap one another: inside a batch they run in
        any order; the batch as a whole runs in stream order. On the legacy
        default stream (handle 0), which the driver refuses for batches, the
        copies go one by one. A batch saves each copy after the first its
        start-up on the copy engine (measured on H200s: two 4 MiB peer copies
        26.7 us one after the other, 24.3 us batched; two 32 KiB ones 5.0 and
        2.6 us).
        """
        if self._batch is None or len(copies) < 2 or stream == 0:
            for dst, src, nbytes in copies:
                self.memcpy(dst, src, nbytes, stream)
            return
        pointer = self._pointer
        result = self._batch(
            [pointer(dst) for dst, _, _ in copies],
            [pointer(src) for _, src, _ in copies],
            [nbytes for _, _, nbytes in copies],
            len(copies),
            self._batch_attrs,
            [0],
            1,
            stream,
        )
        code = result[0] if isinstance(result, tuple) else result
        if code != self._ok:
            cuda.check("cuMemcpyBatchAsync", result)

    def record(self, event: Event, stream: int) -> None:
        """Enqueue a record of ``event`` on ``stream``."""
        result = self._record(event.handle, stream)
        if result[0] != self._ok:
            cuda.check("cuEventRecord", result)

    def wait_event(self, event: Event, stream: int) -> None:
        """Make ``stream`` wait for the latest record of ``event``."""
        result = self._wait_event(stream, event.handle, 0)
        if result[0] != self._ok:
            cuda.check("cuStreamWaitEvent", result)

    def wait_geq(self, stream: int, addr: int, value: int) -> None:
        """Enqueue: hold later work on ``stream`` until the 64-bit flag at ``addr`` is >= ``value`` (cyclic)."""
        result = self._wait_value(stream, addr, value, self._geq)
        if result[0] != self._ok:
            cuda.check("cuStreamWaitValue64", result)

    def write(self, stream: int, addr: int, value: int) -> None:
        """Enqueue: write ``value`` to the 64-bit flag at ``addr`` after earlier work on ``stream``."""
        result = self._write_value(stream, addr, value, self._write_default)
        if result[0] != self._ok:
            cuda.check("cuStreamWriteValue64", result)


def _copy_engine_attributes(drv: Any) -> Any:
    """Attributes for every copy of a batch: read the source in stream order, leave the SMs to compute.

    ``PREFER_OVERLAP_WITH_COMPUTE`` is a hint the driver may ignore; the GPU
    benchmark's interference rows measure what it does.
    """
    attrs = drv.CUmemcpyAttributes()
    attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attrs.flags = drv.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    return attrs


def _bindings_major() -> int:
    """Return the major version of the installed cuda-bindings (0 if it cannot tell)."""
    try:
        from cuda import bindings

        return int(str(bindings.__version__).split(".")[0])
    except (ImportError, AttributeError, ValueError):
        return 0


def batch_api_problem() -> str | None:
    """Return why cuda-bindings or the driver here cannot batch copies, or None if they can; no GPU work.

    cuda-bindings 13 calls the CUDA 13.0 form of ``cuMemcpyBatchAsync`` (no
    ``failIdx``), which a 12.8 or 12.9 driver lacks: it needs a 13.0 driver.
    cuda-bindings 12.8+ calls the 12.8 form, which needs a 12.8 driver.
    """
    drv = _drv()
    if not hasattr(drv, "cuMemcpyBatchAsync") or not hasattr(drv, "CUmemcpyAttributes"):
        return "cuda-bindings has no cuMemcpyBatchAsync (it needs cuda-bindings 12.8 or newer)"
    needed = (13, 0) if _bindings_major() >= 13 else (12, 8)
    have = cuda.driver_version()
    if have < needed:
        return (f"the driver supports CUDA {have[0]}.{have[1]}; batched copies through this cuda-bindings "
                f"need {needed[0]}.{needed[1]}")  # fmt: skip
    return None


def batch_copy_problem(source: int, target: int, stream: int) -> str | None:
    """Try one batched copy of 16 bytes from ``source`` to ``target`` (as two 8-byte pieces) on ``stream``.

    Blocks the host until ``stream`` is idle. Returns None if batching works
    here, else why not (old driver or cuda-bindings, or the call was refused):
    the transport then issues one copy per tensor. The caller picks bytes
    nobody reads. An error that shows up only at the synchronize (the
    context is broken) is raised, not returned.
    """
    problem = batch_api_problem()
    if problem:
        return problem
    try:
        Hot(batch=True).memcpy_all([(target, source, 8), (target + 8, source + 8, 8)], stream)
    except (CudaError, TypeError, RuntimeError) as err:  # refused when enqueued: nothing ran
        return f"cuMemcpyBatchAsync was refused here: {err}"
    stream_synchronize(stream)
    return None


# Memory -------------------------------------------------------------------------


def mem_alloc(nbytes: int) -> int:
    """Allocate ``nbytes`` of device memory in the current context (IPC-shareable); return its address."""
    ptr = int(cuda.call("cuMemAlloc", nbytes))
    _count("allocation", 1)
    return ptr


def mem_free(ptr: int) -> None:
    """Free an allocation from :func:`mem_alloc`. May wait for the device to go idle."""
    cuda.call("cuMemFree", ptr)
    _count("allocation", -1)


def mem_zero(ptr: int, nbytes: int, stream: int) -> None:
    """Enqueue a zero fill of ``nbytes`` at ``ptr`` on ``stream``; does not block."""
    cuda.call("cuMemsetD8Async", ptr, 0, nbytes, stream)


def mem_fill_bytes(ptr: int, value: int, nbytes: int, stream: int) -> None:
    """Enqueue a fill of ``nbytes`` bytes at ``ptr`` with ``value`` on ``stream``; does not block."""
    cuda.call("cuMemsetD8Async", ptr, value, nbytes, stream)


def allocation_of(ptr: int) -> tuple[int, int]:
    """Return ``(base, nbytes)`` of the device allocation that contains address ``ptr``."""
    base, nbytes = cuda.call("cuMemGetAddressRange", ptr)
    return int(base), int(nbytes)


def ipc_handle(ptr: int) -> bytes:
    """Return the 64 bytes of the legacy CUDA IPC handle of allocation ``ptr``."""
    handle = cuda.call("cuIpcGetMemHandle", ptr)
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_NBYTES)


def ipc_open(handle_bytes: bytes) -> int:
    """Map a peer's allocation into this process (peer access enabled lazily); return its address here."""
    drv = _drv()
    if len(handle_bytes) != IPC_HANDLE_NBYTES:
        raise ValueError(f"an IPC handle has {IPC_HANDLE_NBYTES} bytes; got {len(handle_bytes)}")
    handle = drv.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), handle_bytes, IPC_HANDLE_NBYTES)
    ptr = int(cuda.call("cuIpcOpenMemHandle", handle, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
    _count("ipc_mapping", 1)
    return ptr


def ipc_close(ptr: int) -> None:
    """Unmap a peer allocation opened with :func:`ipc_open`."""
    cuda.call("cuIpcCloseMemHandle", ptr)
    _count("ipc_mapping", -1)


# Streams, events, flags ------------------------------------------------------------


def stream_create(highest_priority: bool = False) -> int:
    """Create a stream that never waits for the legacy default stream; return its handle.

    ``highest_priority``: at the context's greatest stream priority (the watchdog's release writes go
    there, so that the hardware scheduler prefers them over the waits they release).
    """
    drv = _drv()
    flags = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
    if highest_priority:
        _least, greatest = cuda.call("cuCtxGetStreamPriorityRange")
        stream = cuda.call("cuStreamCreateWithPriority", flags, int(greatest))
    else:
        stream = cuda.call("cuStreamCreate", flags)
    _count("stream", 1)
    return int(stream)


def stream_destroy(stream: int) -> None:
    """Destroy a stream from :func:`stream_create` (its queued work still completes)."""
    cuda.call("cuStreamDestroy", stream)
    _count("stream", -1)


def stream_synchronize(stream: int) -> None:
    """Block the host until ``stream`` is idle."""
    cuda.call("cuStreamSynchronize", stream)


class Event:
    """A timing-free CUDA event of the current context."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        drv = _drv()
        self.handle = cuda.call("cuEventCreate", int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        _count("event", 1)

    def query(self) -> bool:
        """Return whether the latest record has completed; never blocks."""
        drv = _drv()
        result = drv.cuEventQuery(self.handle)
        code = result[0] if isinstance(result, tuple) else result
        if code == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        cuda.check("cuEventQuery", result)
        return True

    def destroy(self) -> None:
        """Release the event (a pending record still completes)."""
        cuda.call("cuEventDestroy", self.handle)
        _count("event", -1)


def write_value(stream: int, addr: int, value: int) -> None:
    """Enqueue on ``stream``: write ``value`` to the 64-bit flag at ``addr`` after earlier work, with a memory barrier.

    Does not block the host.
    """
    drv = _drv()
    cuda.call(
        "cuStreamWriteValue64", stream, addr, value, int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    )

"""The driver calls of the shim's hot paths, one ``ctypes`` call each (:mod:`syncless._core.libcuda`).

An offloaded D2H job is three driver calls on whichever thread runs it
(:mod:`._worker`): wait for the ready event (skipped when a query finds it
fired already), copy the snapshot's bytes into the pinned destination on
the job's copy stream, wait for that stream. The waits and the copy release
the GIL while they run (under CC the copy itself blocks until it is done);
the calls that only enqueue (the device copy of the snapshot, the event
record) keep it, so no other thread is handed the GIL in the middle of a
hot path. Going through torch instead (``torch.cuda.stream``,
``Tensor.copy_``, the device guard) cost the thread several takes of the GIL
and tens of Python calls per job, and cuda-bindings' wrappers 2-4 us per
call. The ready events come from a per-GPU pool of driver events (no
timing), kept as integer handles, so an offload creates none.

Every call here takes plain integers (device pointers, stream and event
handles) and raises :class:`syncless._core.errors.CudaError` on failure.
Waits are marked as the driver's own
(:func:`syncless._core.driver_waits.standing_for_the_driver`) so that the
hidden-sync detector never counts them.
"""

from __future__ import annotations

import threading
from typing import Any

from syncless._core import cuda as _cuda
from syncless._core import libcuda
from syncless._core.driver_waits import MARKS as _DRIVER_MARKS
from syncless._core.driver_waits import standing_for_the_driver
from syncless.cc import _emulation

_lock = threading.Lock()
_ready_pools: dict[int, list[Any]] = {}
_primary: dict[int, Any] = {}  # device index -> its primary context (retained once, kept for the process)


_DRIVER: list[Any] = [None]


def _drv():
    """cuda-bindings' driver module, initialized (looked up once: every hot path here starts with it)."""
    drv = _DRIVER[0]
    if drv is None:
        drv = _DRIVER[0] = _cuda.ensure_driver()
    return drv


def _ok(name: str, result: Any) -> Any:
    """``result`` of driver call ``name`` (a cuda-bindings tuple) unpacked; raise ``CudaError`` on failure."""
    if result[0]:
        return _cuda.check(name, result)
    return result[1] if len(result) > 1 else None


def primary_context(index: int) -> Any:
    """The primary context of GPU ``index`` (the one torch uses), retained on first use."""
    context = _primary.get(index)
    if context is None:
        drv = _drv()
        device = _ok("cuDeviceGet", drv.cuDeviceGet(index))
        context = _ok("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(device))
        with _lock:
            context = _primary.setdefault(index, context)
    return context


class InContext:
    """``with InContext(index):`` makes GPU ``index``'s primary context current for the block if it is not already.

    One ``cuCtxGetCurrent`` when it is (the common case: the thread runs torch on that GPU); a push and a pop
    otherwise, so the calling thread's own current context (torch's current device) is left as it was.
    """

    __slots__ = ("_index", "_pushed")

    def __init__(self, index: int) -> None:
        self._index = index
        self._pushed = False

    def __enter__(self) -> None:
        self._pushed = enter_context(self._index)

    def __exit__(self, *exc_info: object) -> None:
        if self._pushed:
            _ok("cuCtxPopCurrent", _drv().cuCtxPopCurrent())


def take_ready_event(index: int) -> int:
    """A driver event of GPU ``index`` (timing off; its handle as an int) from the pool, made if the pool is empty.
    Host only."""
    pool = _ready_pools.get(index)
    if pool:
        try:
            return pool.pop()
        except IndexError:  # another thread took the last one
            pass
    drv = _drv()
    with InContext(index):
        return int(_ok("cuEventCreate", drv.cuEventCreate(int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING))))


def give_back_ready_event(index: int, event: Any) -> None:
    """Return ``event`` to GPU ``index``'s pool: its last record has been waited for (or was never made)."""
    pool = _ready_pools.get(index)
    if pool is None:
        with _lock:
            pool = _ready_pools.setdefault(index, [])
    pool.append(event)


def record_ready(event: int, stream: Any) -> None:
    """Enqueue a record of driver event ``event`` on torch stream ``stream`` (GPU-side; never blocks; GIL held)."""
    code = libcuda.libraries()[0].cuEventRecord(event, stream.cuda_stream)
    if code:
        libcuda.raise_for("cuEventRecord", code)


def copy_device_block(index: int, dst_ptr: int, src_ptr: int, nbytes: int, stream: Any) -> None:
    """Enqueue a device-to-device copy of ``nbytes`` on torch stream ``stream`` of GPU ``index`` (asynchronous, CC
    or not; GIL held), its context made current for the call if it is not."""
    quick = libcuda.libraries()[0]
    pushed = enter_context(index)
    try:
        code = quick.cuMemcpyDtoDAsync_v2(dst_ptr, src_ptr, nbytes, stream.cuda_stream)
    finally:
        if pushed:
            _ok("cuCtxPopCurrent", _drv().cuCtxPopCurrent())
    if code:
        libcuda.raise_for("cuMemcpyDtoDAsync", code)


def snapshot_and_record(index: int, dst_ptr: int, src_ptr: int, nbytes: int, stream: Any, event: int) -> None:
    """Enqueue on torch stream ``stream`` of GPU ``index`` a device-to-device copy of ``nbytes`` (none if 0), then a
    record of driver event ``event`` after it: the helper path's two enqueues, with one context check for both.
    Never blocks; GIL held.

    Raises :class:`CudaError`: its ``call`` is ``"cuMemcpyDtoDAsync"`` if the copy failed (then nothing was
    enqueued) and ``"cuEventRecord"`` if the record did (then the copy is enqueued).
    """
    quick = libcuda.libraries()[0]
    handle = stream.cuda_stream
    pushed = enter_context(index)
    try:
        if nbytes:
            code = quick.cuMemcpyDtoDAsync_v2(dst_ptr, src_ptr, nbytes, handle)
            if code:
                libcuda.raise_for("cuMemcpyDtoDAsync", code)
        code = quick.cuEventRecord(event, handle)
    finally:
        if pushed:
            _ok("cuCtxPopCurrent", _drv().cuCtxPopCurrent())
    if code:
        libcuda.raise_for("cuEventRecord", code)


def leave_context() -> None:
    """Pop the context :func:`enter_context` pushed."""
    _ok("cuCtxPopCurrent", _drv().cuCtxPopCurrent())


def enter_context(index: int) -> bool:
    """Make GPU ``index``'s primary context current if it is not; return whether it was pushed (then
    :func:`leave_context` after).

    One ``cuCtxGetCurrent`` (through ctypes) when it is current already: the common case, a thread that runs torch
    on that GPU.
    """
    context = _primary_handles.get(index)
    if context is None:
        context = _primary_handles[index] = int(primary_context(index))
    if libcuda.current_context() == context:
        return False
    _ok("cuCtxPushCurrent", _drv().cuCtxPushCurrent(_primary[index]))
    return True


_primary_handles: dict[int, int] = {}  # device index -> its primary context's handle as an int


def run_copy_job(index: int, ready: int, host_ptr: int, device_ptr: int, nbytes: int, stream: Any) -> None:
    """An offloaded copy's job in three driver calls: wait for ``ready``, copy to the host on torch stream ``stream``,
    wait for that stream. Blocks the calling thread for the ready event and the transfer (the GIL released while it
    waits); GPU ``index``'s context is made current for it if it is not (and put back after).

    A ready event that a query finds fired already is not waited for (the decode loop's case: it reads the copy a
    step late, or the look of :mod:`._fast` found it drained), which saves a release and a take of the GIL. The
    copy keeps the GIL only where it is known to return at once (:data:`COPY_ONLY_ENQUEUES`: CC emulated on a GPU
    NVML says has CC off); then the synchronize of ``stream`` is the one wait, the one CC would make, and a job
    whose event has fired lets go of the GIL once, not twice (each take of it back while another thread runs Python
    is a hand-off that thread pays for, issue 33). Anywhere else the copy may itself block (under CC it returns
    once done), so it lets go of the GIL; where NVML confirmed CC at ``install()``, a query (GIL held) then confirms
    the stream is done and nothing else waits.

    The wait for ``ready`` stays on the host, never on ``stream``: a GPU-side wait there would hold whatever else
    shares ``stream``'s hardware queue behind the producer of ``ready`` (review of run 52's code).
    """
    quick, blocking = libcuda.libraries()
    handle = stream.cuda_stream
    pushed = enter_context(index)
    try:
        with standing_for_the_driver():
            _wait_unless_done(ready, quick.cuEventQuery, blocking.cuEventSynchronize, "cuEvent")
            if nbytes:
                enqueues_only = COPY_ONLY_ENQUEUES[0] and _emulation.is_emulating()
                copy = quick.cuMemcpyDtoHAsync_v2 if enqueues_only else blocking.cuMemcpyDtoHAsync_v2
                code = copy(host_ptr, device_ptr, nbytes, handle)
                if code:
                    libcuda.raise_for("cuMemcpyDtoHAsync", code)
            _wait_unless_done(handle, quick.cuStreamQuery if COPIES_FINISH_AT_CALL[0] else None,
                              blocking.cuStreamSynchronize, "cuStream")
    finally:
        if pushed:
            _ok("cuCtxPopCurrent", _drv().cuCtxPopCurrent())


def copy_to_host_now(host_ptr: int, device_ptr: int, nbytes: int, handle: int) -> None:
    """A device-to-host copy of ``nbytes`` (none if 0) on stream ``handle``, finished when this returns: the small
    readback read at the call (:mod:`._fast`), where the host waits for the copy anyway (under CC, or emulated).

    Emulated, two driver calls: the copy (GIL held where it only enqueues, :data:`COPY_ONLY_ENQUEUES`; released
    where it may block: emulated on a GPU with CC on), then the wait CC makes for ``stream`` (GIL released). Under
    CC (NVML confirmed it at ``install()``) one: the copy, which returns once it is done, the premise torch's own
    copy at the call relies on there too (:func:`._fast._read_back_now` makes no call after it either; a query
    here would also be a call on a stream while another thread may have begun a global-mode capture). Blocks the
    host for the transfer. The caller has made the GPU's context current and holds ``host_ptr``'s pinned block,
    which torch's host allocator knows no copy of: on any failure here the caller must keep the block (a copy may
    have been enqueued into it).

    Raises :class:`CudaError`: its ``call`` is ``"cuMemcpyDtoHAsync"`` when the copy call failed (emulated on a
    GPU with CC off: refused, nothing enqueued; where the call blocks, it may have been enqueued) and
    ``"cuStreamSynchronize"`` when the wait failed.
    """
    quick, blocking = libcuda.LOADED[0] or libcuda.libraries()
    marks = _DRIVER_MARKS
    depth = getattr(marks, "depth", 0)
    marks.depth = depth + 1  # (standing_for_the_driver, inline: this is the readback of every decode step)
    try:
        if nbytes:
            copy = quick.cuMemcpyDtoHAsync_v2 if COPY_ONLY_ENQUEUES[0] else blocking.cuMemcpyDtoHAsync_v2
            code = copy(host_ptr, device_ptr, nbytes, handle)
            if code:
                libcuda.raise_for("cuMemcpyDtoHAsync", code)
        if not COPIES_FINISH_AT_CALL[0]:
            code = blocking.cuStreamSynchronize(handle)
            if code:
                libcuda.raise_for("cuStreamSynchronize", code)
    finally:
        marks.depth = depth


# Pinned results of reads at the call that failed after their copy may have been enqueued (:func:`._fast.
# _read_back_into`): kept for the process's life, so that torch's host allocator, which knows no event for them,
# never hands one out again while the copy may still write it. Bounded (each is at most 4 KiB): past the bound the
# oldest goes, long after its copy ended or its context failed for good.
PARKED: list[Any] = []
_MAX_PARKED = 1024


def park(block: Any) -> None:
    """Keep ``block`` (see :data:`PARKED`)."""
    with _lock:
        PARKED.append(block)
        del PARKED[:-_MAX_PARKED]


def _wait_unless_done(handle: Any, query: Any, wait: Any, prefix: str) -> None:
    """``query(handle)`` (GIL held; None: not asked, taken as not ready), then ``wait(handle)`` (GIL released) only if
    it is not ready; raise ``CudaError`` named ``<prefix>Query`` / ``<prefix>Synchronize`` for a failure."""
    code = query(handle) if query is not None else libcuda.CUDA_ERROR_NOT_READY
    if code == libcuda.CUDA_ERROR_NOT_READY:
        code = wait(handle)
        if code:
            libcuda.raise_for(prefix + "Synchronize", code)
    elif code:
        libcuda.raise_for(prefix + "Query", code)


# Whether a host<->device copy has finished when its driver call returns: NVML confirmed CC at install() (set by
# syncless.cc.install; _host_writes.COPIES_FINISH_AT_CALL is this same list).
COPIES_FINISH_AT_CALL = [False]
# Whether a host<->device copy only enqueues (returns at once): install("emulate") on a GPU that NVML says has CC
# off (set by syncless.cc.install). Emulated on a CC machine the driver's copy still blocks, so it lets go of the GIL.
COPY_ONLY_ENQUEUES = [False]


def forget_after_fork() -> None:
    """In a forked child: forget the pools (the parent's driver objects are not valid there)."""
    _ready_pools.clear()
    _primary.clear()
    _primary_handles.clear()

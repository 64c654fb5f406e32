"""The driver calls of the shim's hot paths, one cuda-bindings call each (each releases the GIL while it runs).

An offloaded D2H job is three driver calls on whichever thread runs it
(:mod:`._worker`): wait for the ready event, copy the snapshot's bytes into
the pinned destination on the job's copy stream, wait for that stream. Going
through torch instead (``torch.cuda.stream``, ``Tensor.copy_``, the device
guard) cost the thread several takes of the GIL and tens of Python calls per
job. The ready events come from a per-GPU pool of driver events (no timing),
so an offload creates none.

Every call here takes plain integers (device pointers, stream handles) and
raises :class:`syncless._core.errors.CudaError` on failure. Waits are marked
as the driver's own (:func:`syncless._core.driver_waits.standing_for_the_driver`)
so that the hidden-sync detector never counts them.
"""

from __future__ import annotations

import threading
from typing import Any

from syncless._core import cuda as _cuda
from syncless._core.driver_waits import standing_for_the_driver

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
        self._pushed = _enter_context(_drv(), self._index)

    def __exit__(self, *exc_info: object) -> None:
        if self._pushed:
            _ok("cuCtxPopCurrent", _drv().cuCtxPopCurrent())


def take_ready_event(index: int) -> Any:
    """A driver event of GPU ``index`` (timing off) from the pool, made if the pool is empty. Host only."""
    pool = _ready_pools.get(index)
    if pool:
        try:
            return pool.pop()
        except IndexError:  # another thread took the last one
            pass
    drv = _drv()
    with InContext(index):
        return _ok("cuEventCreate", drv.cuEventCreate(int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)))


def give_back_ready_event(index: int, event: Any) -> None:
    """Return ``event`` to GPU ``index``'s pool: its last record has been waited for (or was never made)."""
    pool = _ready_pools.get(index)
    if pool is None:
        with _lock:
            pool = _ready_pools.setdefault(index, [])
    pool.append(event)


def record_ready(event: Any, stream: Any) -> None:
    """Enqueue a record of driver event ``event`` on torch stream ``stream`` (GPU-side; never blocks)."""
    _ok("cuEventRecord", _drv().cuEventRecord(event, stream.cuda_stream))


def copy_device_block(index: int, dst_ptr: int, src_ptr: int, nbytes: int, stream: Any) -> None:
    """Enqueue a device-to-device copy of ``nbytes`` on torch stream ``stream`` of GPU ``index`` (asynchronous, CC
    or not), its context made current for the call if it is not."""
    drv = _drv()
    handle = stream.cuda_stream
    pushed = _enter_context(drv, index)
    try:
        result = drv.cuMemcpyDtoDAsync(dst_ptr, src_ptr, nbytes, handle)
    finally:
        if pushed:
            _ok("cuCtxPopCurrent", drv.cuCtxPopCurrent())
    if result[0]:
        _cuda.check("cuMemcpyDtoDAsync", result)


def _enter_context(drv: Any, index: int) -> bool:
    """Make GPU ``index``'s primary context current if it is not; return whether it was pushed (pop it after)."""
    context = _primary.get(index) or primary_context(index)
    current = _ok("cuCtxGetCurrent", drv.cuCtxGetCurrent())
    if current is not None and int(current) == int(context):
        return False
    _ok("cuCtxPushCurrent", drv.cuCtxPushCurrent(context))
    return True


def run_copy_job(index: int, ready: Any, host_ptr: int, device_ptr: int, nbytes: int, stream: Any) -> None:
    """An offloaded copy's job in three driver calls: wait for ``ready``, copy to the host on torch stream
    ``stream``, wait for that stream. Blocks the calling thread (GIL released in each call) for the ready event and the
    transfer; GPU ``index``'s context is made current for it if it is not (and put back after)."""
    drv = _drv()
    handle = stream.cuda_stream
    pushed = _enter_context(drv, index)
    try:
        with standing_for_the_driver():
            _ok("cuEventSynchronize", drv.cuEventSynchronize(ready))
            if nbytes:
                _ok("cuMemcpyDtoHAsync", drv.cuMemcpyDtoHAsync(host_ptr, device_ptr, nbytes, handle))
            _ok("cuStreamSynchronize", drv.cuStreamSynchronize(handle))
    finally:
        if pushed:
            _ok("cuCtxPopCurrent", drv.cuCtxPopCurrent())


def forget_after_fork() -> None:
    """In a forked child: forget the pools (the parent's driver objects are not valid there)."""
    _ready_pools.clear()
    _primary.clear()

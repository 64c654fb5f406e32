"""Thin CUDA helpers: private streams, raw waits, capture checks, stream ordering.

Waits here go through the driver (``cuStreamSynchronize``/``cuEventSynchronize``
via :func:`syncless._core.cuda.call`), not through torch. That is deliberate:
torch's sync debug mode, which the hidden-sync detector arms, flags torch's
``Stream.synchronize`` but cannot see a driver call, so the CC emulator's
waits (which stand for the driver's own behaviour under CC) and the D2H
worker's waits are never reported as the user's syncs. cuda-bindings releases
the GIL around every driver call since 12.9.1 (and 13.0.0), so other Python
threads run while a wait blocks; with an older release the D2H worker's
waits would stall every Python thread (and a caller blocked in a driver wait
while the worker needs the GIL would never wake), so :func:`check_bindings`
refuses it at ``install()``.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from syncless._core import cuda as _cuda
from syncless._core import libcuda
from syncless._core.driver_waits import MARKS as _DRIVER_MARKS
from syncless._core.driver_waits import standing_for_the_driver

BINDINGS_FLOOR = (12, 9, 1)
_BINDINGS_FIX = "pip install -U 'cuda-bindings>=12.9.1'  (or: pip install -U 'syncless[cuda]')"

_lock = threading.Lock()
_worker_streams: dict[int, Any] = {}
_staging: dict[int, Any] = {}
_order_events = threading.local()  # per thread: {device index: event}


def bindings_problem(version: str) -> str | None:
    """Return why cuda-bindings ``version`` cannot serve the shim (its driver calls hold the GIL), or None."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    if tuple(parts) >= BINDINGS_FLOOR:
        return None
    return (
        f"cuda-bindings {version} is installed, but syncless.cc needs >= 12.9.1: older releases hold the GIL during "
        "driver calls, so the D2H worker's waits would stall every Python thread. Upgrade with: " + _BINDINGS_FIX
    )


def check_bindings() -> None:
    """Raise unless cuda-bindings >= 12.9.1 is installed (older releases hold the GIL in driver calls).

    At ``install()``, so a missing package is reported there rather than from inside the first staged copy.

    Raises:
        MissingDependencyError: cuda-bindings is absent, or older than 12.9.1.
    """
    from importlib import metadata

    from syncless._core.errors import MissingDependencyError

    try:
        version = metadata.version("cuda-bindings")
    except metadata.PackageNotFoundError as err:
        raise MissingDependencyError(
            "syncless.cc.install() needs cuda-bindings >= 12.9.1 (the staging and D2H streams are made through the "
            "driver), and it is not installed. Install it with: " + _BINDINGS_FIX
        ) from err
    problem = bindings_problem(version)
    if problem is not None:
        raise MissingDependencyError(problem)


# Stream objects by what torch reports for a current stream: (stream id, device index, device type).
_stream_objects: dict[tuple, Any] = {}
_STREAM_OBJECTS_MAX = 1024


def current_stream(index: int) -> Any:
    """``torch.cuda.current_stream(index)``, from a cache of stream objects; host only, enqueues nothing.

    torch checks its lazy initialization and builds a new ``torch.cuda.Stream``
    on every call: 1.8-3.5 us on an H200 host, and about five times that on a host
    that has just waited (``tests/gpu/cc/probe_h2d_breakdown.py``); a staged
    copy asked up to three times. Here one call asks torch's C layer for the
    stream's id and reuses the object made for that id the first time, so
    equal streams give the same object. Falls back to torch's function where
    its C entry point is missing.
    """
    import torch

    getter = getattr(torch._C, "_cuda_getCurrentStream", None)
    if getter is None or not (_CUDA_UP[0] or _cuda_up(torch)):
        return torch.cuda.current_stream(index)  # also initializes CUDA the way torch does
    key = getter(index)
    stream = _stream_objects.get(key)
    if stream is None:
        if len(_stream_objects) >= _STREAM_OBJECTS_MAX:
            _stream_objects.clear()  # many short-lived external streams: start over rather than grow
        stream = _stream_objects[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                                          device_type=key[2])
    return stream


_CUDA_UP = [False]  # torch.cuda was seen initialized (it stays so; a forked child forgets it: forget_after_fork)


def _cuda_up(torch: Any) -> bool:
    _CUDA_UP[0] = up = torch.cuda.is_initialized()
    return up


def forget_after_fork() -> None:
    """In a forked child: CUDA is not initialized there (torch refuses it); forget that it was here."""
    _CUDA_UP[0] = False
    _STREAM_SYNC[0] = None


def device_index(device: Any) -> int:
    """Return the CUDA device index of ``device`` (None/``"cuda"`` mean the current device)."""
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


class _OnDevice:
    """``with _OnDevice(index):`` makes GPU ``index`` the current device for the block if it is not already.

    A class, not a generator: it sits in every emulated wait, where a generator-based context manager cost
    more than the check itself.
    """

    __slots__ = ("_index", "_switch")

    def __init__(self, index: int) -> None:
        self._index = index
        self._switch = None

    def __enter__(self) -> None:
        import torch

        if _current_device() != self._index:
            self._switch = torch.cuda.device(self._index)
            self._switch.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        if self._switch is not None:
            self._switch.__exit__(*exc_info)


class OnStream:
    """``with OnStream(stream, previous):`` makes ``stream`` current for the block; ``previous`` is current after.

    ``previous`` must be the current stream of ``stream``'s GPU when the block
    is entered (the caller has it at hand). Host-only bookkeeping, nothing is
    enqueued. When that GPU is the current device this is two ``set_stream``
    calls: ``torch.cuda.stream(...)`` costs 8.5 us per use on an H200
    (``tests/gpu/cc/probe_h2d_cost.py``), a large part of a staged copy's
    host time. On another GPU it is ``torch.cuda.stream(stream)`` itself,
    which also switches the current device and back.
    """

    __slots__ = ("_stream", "_previous", "_fallback")

    def __init__(self, stream: Any, previous: Any) -> None:
        self._stream = stream
        self._previous = previous
        self._fallback = None

    def __enter__(self) -> None:
        import torch

        stream = self._stream
        if stream.device_index == _current_device():
            _set_stream(stream)
        else:
            self._fallback = torch.cuda.stream(stream)
            self._fallback.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        if self._fallback is not None:
            self._fallback.__exit__(*exc_info)
        else:
            _set_stream(self._previous)


_C_CALLS: dict[str, Any] = {}  # torch's C entry points by name (None: this torch lacks it), looked up once


def _c_call(name: str) -> Any:
    try:
        return _C_CALLS[name]
    except KeyError:
        import torch

        found = _C_CALLS[name] = getattr(torch._C, name, None)
        return found


def _current_device() -> int:
    """``torch.cuda.current_device()`` through torch's C layer (no lazy-init check: CUDA is up on these paths)."""
    getter = _C_CALLS.get("_cuda_getDevice") or _c_call("_cuda_getDevice")
    if getter is None:
        import torch

        return torch.cuda.current_device()
    return getter()


def _set_stream(stream: Any) -> None:
    """``torch.cuda.set_stream(stream)`` as its one C call (what torch's function makes of it)."""
    setter = _C_CALLS.get("_cuda_setStream") or _c_call("_cuda_setStream")
    if setter is None:
        import torch

        torch.cuda.set_stream(stream)
        return
    setter(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)


def create_private_stream(index: int) -> Any:
    """Create a CUDA stream on GPU ``index`` outside torch's stream pool; return a torch stream object.

    The stream comes from ``cuStreamCreate(CU_STREAM_NON_BLOCKING)`` in the
    device's primary context (the one torch uses) and is wrapped in
    ``torch.cuda.ExternalStream``. torch's pool never hands out this handle,
    so no other code enqueues on it. It lives as long as the process.
    Does not block the host.
    """
    import torch

    drv = _cuda.ensure_driver()
    torch.cuda.init()
    # Create it in the device's primary context (the one torch's runtime uses), whatever is current here.
    device = _cuda.call("cuDeviceGet", index)
    context = _cuda.call("cuDevicePrimaryCtxRetain", device)  # kept for the process, like the stream
    _cuda.call("cuCtxPushCurrent", context)
    try:
        handle = _cuda.call("cuStreamCreate", int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
    finally:
        _cuda.call("cuCtxPopCurrent")
    return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", index))


def _private_stream_of(table: dict[int, Any], index: int) -> Any:
    stream = table.get(index)
    if stream is not None:
        return stream
    with _lock:
        stream = table.get(index)
    if stream is None:
        stream = create_private_stream(index)
        with _lock:
            stream = table.setdefault(index, stream)
    return stream


def staging_stream(index: int) -> Any:
    """Return the idle staging stream of GPU ``index`` (created on first use; only syncless enqueues on it)."""
    return _private_stream_of(_staging, index)


def worker_stream(index: int) -> Any:
    """Return the stream the D2H worker copies on for GPU ``index`` (created on first use; only the worker uses it)."""
    return _private_stream_of(_worker_streams, index)


def order_after(waiter: Any, producer: Any) -> None:
    """Make future work on ``waiter`` wait for the work enqueued on ``producer`` so far.

    GPU-side only (event record + stream wait); the host does not block. One
    cached event per device *and thread* is re-recorded each time: a wait
    enqueued earlier keeps the record it saw, and within one thread the next
    record comes only after this wait is enqueued. (Shared across threads, a
    record by another thread between this record and this wait would make
    ``waiter`` wait on that other stream instead.) Bypasses the patched
    ``Event.record`` (no redirection: neither stream is a D2H stream).
    """
    import torch

    index = producer.device_index
    events = getattr(_order_events, "by_device", None)
    if events is None:
        events = _order_events.by_device = {}
    event = events.get(index)
    if event is None:
        event = events[index] = torch.cuda.Event()
    base = _event_base()
    base.record(event, producer)
    base.wait(event, waiter)


_EVENT_BASE: list[Any] = [None]


def _event_base() -> type:
    """torch's C event class beneath ``torch.cuda.Event`` (its record/wait are C methods, beneath every patch)."""
    base = _EVENT_BASE[0]
    if base is None:
        import torch

        base = _EVENT_BASE[0] = torch.cuda.Event.__mro__[1]
    return base


def wait_stream_raw(stream: Any) -> None:
    """Block the calling thread until ``stream`` has drained, via the driver (invisible to sync debug mode).

    One ``cuStreamSynchronize`` through ctypes, the GIL released while it waits. Marked as a wait that stands for
    the driver's own, so the detector's CUPTI layer does not count it either. The CC emulator makes this wait
    after every copy: when the driver is up and ``stream``'s GPU is current, it is one Python call and two C calls
    (the device check and the wait); otherwise the GPU is made current for it first.
    """
    sync = _STREAM_SYNC[0]
    getter = _C_CALLS.get("_cuda_getDevice")
    if sync is None or getter is None or getter() != stream.device_index:
        _wait_stream_on_its_device(stream)
        return
    depth = getattr(_DRIVER_MARKS, "depth", 0)
    _DRIVER_MARKS.depth = depth + 1
    try:
        code = sync(stream.cuda_stream)
    finally:
        _DRIVER_MARKS.depth = depth
    if code:
        libcuda.raise_for("cuStreamSynchronize", code)


# ``cuStreamSynchronize`` through ctypes with the GIL released, set by the first wait once the driver is initialized.
_STREAM_SYNC: list[Any] = [None]


def _wait_stream_on_its_device(stream: Any) -> None:
    """:func:`wait_stream_raw` with ``stream``'s GPU made current for it (and the driver initialized, first time)."""
    _cuda.ensure_driver()
    with _OnDevice(stream.device_index), standing_for_the_driver():
        sync = libcuda.libraries()[1].cuStreamSynchronize
        code = sync(stream.cuda_stream)
    _STREAM_SYNC[0] = sync
    if code:
        libcuda.raise_for("cuStreamSynchronize", code)


def wait_event_raw(event: Any) -> None:
    """Block the calling thread until ``event`` has fired, via the driver (invisible to sync debug mode)."""
    handle = event.cuda_event
    if handle:  # never recorded: nothing to wait for (same as torch)
        _cuda.ensure_driver()
        with standing_for_the_driver():
            code = libcuda.libraries()[1].cuEventSynchronize(handle)
        if code:
            libcuda.raise_for("cuEventSynchronize", code)


def record_event_raw(event: Any, stream: Any) -> None:
    """Enqueue a record of ``event`` on ``stream``, bypassing the shim's patched ``Event.record``.

    GPU-side only; the host does not block.
    """
    _event_base().record(event, stream)


def is_capturing(stream: Any) -> bool:
    """Return whether ``stream`` is capturing a CUDA graph (asks the driver; does not block)."""
    drv = _cuda.ensure_driver()
    with _OnDevice(stream.device_index):
        status = _cuda.call("cuStreamIsCapturing", stream.cuda_stream)
    return status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


# CUDA graphs between CUDAGraph.capture_begin and capture_end, on any thread (the shim and the emulator patch both:
# see ._sync_patches, ._emulation), each with whether it captures in torch's default "global" mode. Such a capture
# is invalidated by a host synchronize on any other thread, so while one is open the emulator makes no wait; while
# any capture is open (conservatively, whatever its mode) nothing is offloaded (the D2H worker synchronizes).
_capturing_graphs: dict[int, bool] = {}
CAPTURES = [0]  # captures open, any mode
GLOBAL_CAPTURES = [0]  # of those, the ones in global mode


def capture_mode_is_global(args: tuple, kwargs: dict) -> bool:
    """Whether ``CUDAGraph.capture_begin(*args, **kwargs)`` captures in global mode (torch's default), read from its
    ``capture_error_mode`` (``self, pool=None, capture_error_mode="global"``); any form not understood counts as
    global (the conservative reading)."""
    mode = kwargs.get("capture_error_mode", args[2] if len(args) > 2 else "global")
    return mode not in ("thread_local", "relaxed")


def note_capture(graph: Any, capturing: bool, global_mode: bool = True) -> None:
    """Record that ``graph`` began (``capturing``, in global mode or not) or ended its capture; host-only
    bookkeeping."""
    with _lock:
        if capturing:
            _capturing_graphs[id(graph)] = global_mode
        else:
            _capturing_graphs.pop(id(graph), None)
        CAPTURES[0] = len(_capturing_graphs)
        GLOBAL_CAPTURES[0] = sum(_capturing_graphs.values())


def forget_captures() -> None:
    """Forget every capture noted (tests)."""
    with _lock:
        _clear_captures()


def _clear_captures() -> None:
    """Forget every capture noted (the caller holds ``_lock``)."""
    _capturing_graphs.clear()
    CAPTURES[0] = GLOBAL_CAPTURES[0] = 0


_noters: set[str] = set()  # the installed layers that note captures ("shim", "emulation")


def start_noting(key: str) -> None:
    """Layer ``key``'s capture hooks are installed: with no other such layer installed before it, captures noted
    earlier are forgotten (begun or ended while nothing noted them, they are not seen); with one, they stay (found
    in review: installing the shim over the emulator forgot a capture the emulator had noted, still open)."""
    with _lock:
        if not _noters:
            _clear_captures()
        _noters.add(key)


def stop_noting(key: str) -> None:
    """Layer ``key``'s capture hooks are removed: once no such layer is left, the captures noted are forgotten (one
    that ends unseen would otherwise stay noted, and the emulator make no wait for good; found in review)."""
    with _lock:
        _noters.discard(key)
        if not _noters:
            _clear_captures()


def wrap_capture_begin(next_begin, before=None):
    """A ``CUDAGraph.capture_begin`` layer that notes the capture (``before(graph, global_mode)`` if given, which
    must note it, else :func:`note_capture`) before it begins, and forgets it if beginning fails."""

    def capture_begin(*args, **kwargs):
        graph = args[0] if args else None
        global_mode = capture_mode_is_global(args, kwargs)
        (before or _note_begun)(graph, global_mode)
        try:
            return next_begin(*args, **kwargs)
        except BaseException:
            note_capture(graph, False)
            raise

    return capture_begin


def _note_begun(graph: Any, global_mode: bool) -> None:
    note_capture(graph, True, global_mode)


def wrap_capture_end(next_end):
    """A ``CUDAGraph.capture_end`` layer that forgets the capture once it has ended (or failed to)."""

    def capture_end(*args, **kwargs):
        try:
            return next_end(*args, **kwargs)
        finally:
            note_capture(args[0] if args else None, False)

    return capture_end


def any_current_capture(index: int) -> bool:
    """Return whether a capture is open: any graph between ``CUDAGraph.capture_begin`` and ``capture_end`` on any
    thread (while the shim is installed), or the current stream of GPU ``index`` or of the current device."""
    return bool(CAPTURES[0]) or is_current_stream_capturing(index)


def this_thread_captures() -> bool:
    """Whether this thread's current stream of the current device is capturing a graph (False on a torch built
    without CUDA, where torch refuses to ask)."""
    import torch

    try:
        return torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):
        return False


def is_current_stream_capturing(index: int) -> bool:
    """Return whether this thread's current stream of the current device, or of GPU ``index``, is capturing: then
    work issued now is a graph node, not work on the stream."""
    import torch

    if torch.cuda.is_current_stream_capturing():
        return True
    if index == torch.cuda.current_device():
        return False
    return is_capturing(current_stream(index))

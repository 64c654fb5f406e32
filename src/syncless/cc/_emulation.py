"""CC emulation: host<->device copies become host-synchronous the way CC makes them.

Under NVIDIA Confidential Computing, data crosses PCIe through encrypted
bounce buffers and ``cudaMemcpyAsync`` between host and device returns only
after the copy *and all earlier work on its stream* has finished. This layer
reproduces that on a GPU without CC: after each ``non_blocking``
host<->device ``Tensor.to``/``Tensor.cuda``/``Tensor.copy_`` (also when
spelled with torch's deprecated ``async=True``) it blocks the host until the
stream the copy ran on (the current stream of the CUDA side's device) drains.

It sits beneath the shim (rank ``RANK_CC_EMULATION``). The shim's own
staged copies call torch's method and then :func:`wait_after_copy_on` for
the stream they used: the same wait, without this layer reading the call
a second time. Its waits use the driver's
``cuStreamSynchronize`` (see :mod:`._streams`): they stand for the driver,
not for the user's code, so torch's sync debug mode (and with it the
hidden-sync detector) never reports them.
"""

from __future__ import annotations

import threading
from typing import Any

from syncless._core import patching
from syncless._core.compiling import is_compiling
from syncless._core.tensor_calls import maybe_non_blocking_to, parse_to, read_copy, read_cuda
from syncless.cc import _routing, _streams
from syncless.cc._layers import EMULATION_KEY, TENSOR_ATTRS, call_for_waiting
from syncless.cc._stats import COUNTERS

_lock = threading.Lock()
_installed = False


def _emulate_wait(cuda_device: Any) -> None:
    """Block the host until the current stream of ``cuda_device`` drains; skip it while a graph is captured.

    Skipped if that stream, or the current stream of the current device, is capturing.
    """
    index = _streams.device_index(cuda_device)
    # A capture in torch's global mode on any thread (another thread's host synchronize would invalidate it), or this
    # thread's current stream capturing: no wait. A thread_local or relaxed capture on another thread allows the
    # wait, and CC's driver would make it (found in review: every mode was skipped).
    if _streams.GLOBAL_CAPTURES[0] or _streams.is_current_stream_capturing(index):
        return
    _streams.wait_stream_raw(_streams.current_stream(index))
    COUNTERS.add("emulated_waits")


def wait_after_copy_on(stream: Any) -> None:
    """If CC is emulated: block the host until ``stream`` drains, as the driver does after a copy on it.

    For the shim's own host<->device copies, which it issues with torch's own
    method on a stream it knows (the staging stream) and never while a graph
    is captured: the wait the emulation layer would make, without reading the
    call again. Does nothing when CC is not emulated.
    """
    if _installed:
        _streams.wait_stream_raw(stream)
        COUNTERS.add("emulated_waits")


def _wrap_to(next_to):
    def to(*args, **kwargs):
        # The call goes beneath as given (see ._layers); it is read only after torch accepted it.
        if is_compiling() or not args or not maybe_non_blocking_to(args[1:], kwargs):
            return next_to(*args, **kwargs)
        result = next_to(*args, **kwargs)
        if not call_for_waiting(args, kwargs):
            return result  # an override took the call; its call back into torch was emulated
        self = args[0]
        device, _, non_blocking, _ = parse_to(args[1:], kwargs)
        if device is not None and _routing.needs_emulated_wait(self.device.type, device.type, non_blocking,
                                                               False, False):
            _emulate_wait(device if device.type == "cuda" else self.device)
        return result

    return to


def _wrap_cuda(next_cuda):
    def cuda(*args, **kwargs):
        # The call goes beneath as given (see ._layers); it is read only after torch accepted it.
        result = next_cuda(*args, **kwargs)
        read = read_cuda(args[1:], kwargs, deprecated_async=True)
        if read is None or read[1] is not True or is_compiling() or not call_for_waiting(args, kwargs):
            return result  # blocking, or an override took the call (its call back into torch was emulated)
        if _routing.needs_emulated_wait(args[0].device.type, "cuda", True, False, False):
            _emulate_wait(result.device)
        return result

    return cuda


def _wrap_copy(next_copy):
    def copy_(*args, **kwargs):
        # The call goes beneath as given (see ._layers); it is read only after torch accepted it.
        if len(args) == 2 and not kwargs:
            return next_copy(*args)  # dst.copy_(src): blocking, nothing to emulate
        result = next_copy(*args, **kwargs)
        read = read_copy(args[1:], kwargs, deprecated_async=True)
        if read is None or read[1] is not True or is_compiling() or not call_for_waiting(args, kwargs):
            return result  # blocking, or an override took the call (its call back into torch was emulated)
        self, other = args[0], read[0]
        src_type = getattr(getattr(other, "device", None), "type", "cpu")
        if _routing.needs_emulated_wait(src_type, self.device.type, True, False, False):
            _emulate_wait(self.device if self.device.type == "cuda" else other.device)
        return result

    return copy_


_WRAPPERS = {"to": _wrap_to, "cuda": _wrap_cuda, "copy_": _wrap_copy}
_generation = [0]  # bumped at each install: a handle ends only the emulation it started


def _capture_targets() -> list[tuple[Any, str, Any]]:
    """``CUDAGraph.capture_begin``/``capture_end``, noted by the emulator too: with the emulator alone (no shim, whose
    hooks also note them) another thread's capture was not seen, and a wait here invalidated it (found in review)."""
    import torch

    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is None or "capture_begin" not in vars(graph) or "capture_end" not in vars(graph):
        return []
    return [(graph, "capture_begin", _streams.wrap_capture_begin), (graph, "capture_end", _streams.wrap_capture_end)]


def install_emulation() -> bool:
    """Add the emulation layer to ``Tensor.to/cuda/copy_`` and the capture hooks; return False if it was already
    there."""
    import torch

    global _installed
    with _lock:
        if _installed:
            return False
        for name in TENSOR_ATTRS:
            patching.add_layer(torch.Tensor, name, EMULATION_KEY, patching.RANK_CC_EMULATION, _WRAPPERS[name])
        _streams.start_noting("emulation")
        for owner, name, wrap in _capture_targets():
            patching.add_layer(owner, name, EMULATION_KEY, patching.RANK_CC_EMULATION, wrap)
        _generation[0] += 1
        _installed = True
        return True


def uninstall_emulation(generation: int | None = None) -> bool:
    """Remove the emulation layer; return False if it was not there (or, given ``generation``, if the one there
    is not the emulation installed then)."""
    import torch

    global _installed
    with _lock:
        if not _installed or (generation is not None and generation != _generation[0]):
            return False
        for name in TENSOR_ATTRS:
            patching.remove_layer(torch.Tensor, name, EMULATION_KEY)
        for owner, name, _ in _capture_targets():
            patching.remove_layer(owner, name, EMULATION_KEY)
        _streams.stop_noting("emulation")
        _installed = False
        return True


def is_emulating() -> bool:
    """Return whether the emulation layer is installed."""
    return _installed


class Emulation:
    """Handle returned by :func:`emulate`; a context manager that ends the emulation it started (not one installed
    after it was ended another way: ``uninstall()`` and a new ``install("emulate")`` inside its block)."""

    def __init__(self, start: bool = True) -> None:
        self.started = install_emulation() if start else False
        self._generation = _generation[0]
        self._open = True

    def stop(self) -> None:
        """End the emulation if this handle started it and it is still the one installed (idempotent)."""
        if self._open and self.started:
            uninstall_emulation(self._generation)
        self._open = False

    def __enter__(self) -> Emulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

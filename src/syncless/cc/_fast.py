"""The shim's fast lane: ``x.to(device, non_blocking=True)`` of a plain tensor, the call a decode loop makes each step.

At batch 1 the host is the bottleneck, and the general path of
:mod:`._shim` (read the call, gather :class:`._routing.CopyFacts`, route)
cost an offloaded readback about 54 syncless Python calls and a staged
upload about 48 (issue 33, ``tests/gpu/cc/probe_call_counts.py``). This
lane takes the two common forms, ``t.to("cpu", non_blocking=True)`` on a
D2H stream and ``h.to("cuda", non_blocking=True)``, in one function each
with the checks inline, as direct calls of torch's C layer. It routes
exactly as :func:`._routing.route_copy` would (offload / stage), and gives
up (returns None, having done nothing) on anything else, which the general
path then reads: a subclass or a mode, a GPU other than the current one, a
graph capture, a strided layout that is not contiguous, a conjugate or
negative view, autograd, a copy past ``max_staged_bytes``, a host tensor
that is not on the CPU, a D2H stream current while an H2D is issued. An
upload while nothing is queued on the current stream is torch's own copy
(``left_alone["idle_stream"]``): under CC it then waits for the transfer
alone, which is all the staging stream would have saved, without the
staging's own cost (run 30: 47.4 us staged against 34.0 us for the transfer
alone, 1 MiB on an idle H200).

Python calls on the lane (counted with ``sys.setprofile``, docs/cc.md):
the offload and the staged upload, each about a dozen of syncless's own.
"""

from __future__ import annotations

from typing import Any

from syncless._core.tensor_calls import _torch_checks
from syncless.cc import _d2h, _host_writes, _staging, _streams
from syncless.cc._stats import COUNTERS


class _Lane:
    """torch's C entry points the lane calls, looked up once (``ready`` False: this torch lacks one; no lane)."""

    def __init__(self) -> None:
        import torch

        c = torch._C
        checks = _torch_checks()  # the override, mode and functorch checks every routed call makes
        self.tensor = torch.Tensor
        self.device_type = torch.device
        self.strided = torch.strided
        self.grad_enabled = torch.is_grad_enabled
        self.has_override = checks.has_torch_function_unary
        self.dispatch_depth = checks.dispatch_stack_len
        self.functorch_peek = checks.functorch_peek
        self.functorch_wrapped = checks.functorch_wrapped
        self.current_device = getattr(c, "_cuda_getDevice", None)
        self.raw_stream = getattr(c, "_cuda_getCurrentRawStream", None)
        self.capturing = getattr(c, "_cuda_isCurrentStreamCapturing", None)
        stream_base = getattr(c, "_CudaStreamBase", None)
        self.stream_query = getattr(stream_base, "query", None)  # beneath the shim's patch of Stream.query
        self.ready = None not in (self.dispatch_depth, self.functorch_peek, self.functorch_wrapped,
                                  self.current_device, self.raw_stream, self.capturing, self.stream_query)
        self.devices: dict[str, Any] = {}  # "cpu", "cuda", "cuda:1": torch.device, read once each


_LANE: list[_Lane | None] = [None]
PASS_ON = object()  # what :func:`to` returns when torch's own copy, called as given, is the right one
_MAX_DEVICE_NAMES = 64


def _lane() -> _Lane:
    lane = _LANE[0]
    if lane is None:
        lane = _LANE[0] = _Lane()
    return lane


def _device(lane: _Lane, where: Any) -> Any:
    """``where`` as a ``torch.device`` when it is one or a device string (None otherwise: the general path reads it)."""
    if type(where) is lane.device_type:
        return where
    if type(where) is not str:
        return None
    device = lane.devices.get(where)
    if device is None:
        try:
            device = lane.device_type(where)
        except (RuntimeError, TypeError, ValueError):
            return None  # torch refuses it: the general path passes the call on, and torch raises its own error
        if len(lane.devices) < _MAX_DEVICE_NAMES:
            lane.devices[where] = device
    return device


def to(self: Any, where: Any, max_staged_bytes: int) -> Any:
    """``self.to(where, non_blocking=True)`` through the lane, or None (nothing done) if the lane does not take it,
    or :data:`PASS_ON`: the caller calls torch's own copy as given (an upload to an idle stream).

    The caller has checked the call's form (two positional arguments, ``non_blocking=True`` alone as a keyword)
    and that dynamo is not tracing.
    """
    lane = _LANE[0] or _lane()
    if (not lane.ready or type(self) is not lane.tensor or lane.has_override(self) or lane.dispatch_depth()
            or lane.functorch_peek() is not None or lane.functorch_wrapped(self)):
        return None
    device = lane.devices.get(where) if type(where) is str else None
    if device is None:
        device = _device(lane, where)
    if device is None or _streams.CAPTURES[0]:
        return None
    if self.is_cuda:
        return _offload(lane, self, device, max_staged_bytes) if device.type == "cpu" else None
    if device.type == "cuda" and self.is_cpu:
        return _stage(lane, self, device, max_staged_bytes)
    return None


def _plain_block(lane: _Lane, t: Any, max_staged_bytes: int) -> bool:
    """Whether ``t`` is one dense block the lane may move as it lies (what the general path routes the same way)."""
    return (t.layout is lane.strided and not t.is_nested and not t.is_quantized and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and t.nbytes <= max_staged_bytes)


def _offload(lane: _Lane, self: Any, device: Any, max_staged_bytes: int) -> Any:
    """``self.to("cpu", non_blocking=True)`` offloaded, if the current stream of ``self``'s GPU is a D2H stream.

    Enqueues on that D2H stream a device copy of ``self`` (the snapshot) and its ready event; returns the new
    pinned tensor at once (the host does not block). None when the general path must decide.
    """
    streams = _d2h._streams_by_key
    if not streams:
        return None
    index = self.get_device()
    if index != lane.current_device() or lane.capturing():
        return None
    record = streams.get((index, lane.raw_stream(index)))
    if record is None or not _plain_block(lane, self, max_staged_bytes):
        return None
    if self.requires_grad and lane.grad_enabled():
        return None  # torch records the copy for autograd: its own copy (general path: "autograd")
    dst = _d2h.pinned_block(self, self.dtype)
    if not _d2h.offload_block(record, dst, self, index):
        return None  # no room for the snapshot, or offloading is closed: the general path runs torch's own
    COUNTERS.add("offloaded")
    return dst


def _stage(lane: _Lane, self: Any, device: Any, max_staged_bytes: int) -> Any:
    """``self.to(device, non_blocking=True)`` for a host tensor, staged (:func:`._staging.land`), or None."""
    index = device.index
    current_device = lane.current_device()
    if index is None:
        index = current_device
    if index != current_device or lane.capturing() or not _plain_block(lane, self, max_staged_bytes):
        return None
    if _d2h._PENDING[0] and _d2h._streams_by_key and (index, lane.raw_stream(index)) in _d2h._streams_by_key:
        return None  # a D2H stream is current: the general path waits for its offloaded copies first
    current = _streams.current_stream(index)
    if lane.stream_query(current):
        # Nothing is queued on the current stream: staging would hide nothing (under CC torch's own copy waits
        # for the transfer alone) and only add its own cost. torch's copy, on the current stream, after the
        # offloaded copies still writing this host memory (the host waits for those, as a staged copy does).
        _host_writes.order_after_pending_writes(current, self)
        COUNTERS.left_alone("idle_stream")
        return PASS_ON
    COUNTERS.add("staged")
    return _staging.land(self, index, current=current)

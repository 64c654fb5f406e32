"""The shim's fast lane: ``x.to(device, non_blocking=True)`` of a plain tensor, the call a decode loop makes each step.

At batch 1 the host is the bottleneck, and the general path of
:mod:`._shim` (read the call, gather :class:`._routing.CopyFacts`, route)
cost an offloaded readback about 54 syncless Python calls and a staged
upload about 48 (issue 33, ``tests/gpu/cc/probe_call_counts.py``). This
lane takes the two common forms, ``t.to("cpu", non_blocking=True)`` on a
D2H stream and ``h.to("cuda", non_blocking=True)``, in one function each
with the checks inline, as direct calls of torch's C layer, and gives up
(returns None, having done nothing) on anything else, which the general
path then reads: a subclass or a mode, a GPU other than the current one, a
graph capture, a strided layout that is not contiguous, a conjugate or
negative view, autograd, a copy past ``max_staged_bytes``, a host tensor
that is not on the CPU, a D2H stream current while an H2D is issued, a
ZeroTensor on either side (``torch._efficientzerotensor``: plain and
contiguous, but its data pointer is 0; torch's copy reads no bytes of it, or
refuses to write it, and the general path leaves it to torch).

- A readback is offloaded as :func:`._routing.route_copy` would route it.
- An upload of at most ``SYNCLESS_CC_INLINE_MAX_BYTES`` (4080 by default:
  token ids, positions, a sampling table) is one kernel launch whose
  parameters carry the bytes (:mod:`._inline_h2d`): nothing waits, under
  CC or not. So is a ``dst.copy_(h, non_blocking=True)`` of that size into
  a contiguous tensor of the same dtype and shape (:func:`copy_into`).
- A larger upload while nothing is queued on the current stream is torch's
  own copy (``left_alone["idle_stream"]``): under CC it then waits for the
  transfer alone, which is all the staging stream would have saved,
  without the staging's own cost (run 30: 47.4 us staged against 34.0 us
  for the transfer alone, 1 MiB on an idle H200). Else it is staged.

Python calls on the lane (counted with ``sys.setprofile``, docs/cc.md):
the offload and the upload, each about a dozen of syncless's own.
"""

from __future__ import annotations

from time import perf_counter as _clock
from typing import Any

from syncless._core.errors import CudaError
from syncless._core.tensor_calls import _torch_checks
from syncless.cc import _d2h, _emulation, _helper, _host_writes, _inline_h2d, _raw, _staging, _streams
from syncless.cc._stats import COUNTERS


class _Lane:
    """torch's C entry points the lane calls, looked up once (``ready`` False: this torch lacks one; no lane)."""

    def __init__(self) -> None:
        import torch

        c = torch._C
        checks = _torch_checks()  # the override, mode and functorch checks every routed call makes
        self.tensor = torch.Tensor
        self.empty_strided = torch.empty_strided
        self.device_type = torch.device
        self.strided = torch.strided
        self.grad_enabled = torch.is_grad_enabled
        self.inference_mode = torch.is_inference_mode_enabled
        self.forward_ad = torch.autograd.forward_ad  # its _current_level: see in_dual_level
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
        self.torch_to = _staging._torch_own("to")  # beneath every syncless layer, the emulator's too


_LANE: list[_Lane | None] = [None]
_MAX_DEVICE_NAMES = 64
# A readback smaller than this from a D2H stream that has drained, or drains within DRAIN_LOOK_S, is torch's own copy
# (:func:`_read_back_now`): a copy this small is all latency (about 10 us on an H200, run 37), less than what
# offloading it costs the host.
READ_BACK_NOW_BYTES = 4096
# How long a small readback looks for its D2H stream to drain before it is offloaded (seconds). Runs 51 and 53, the
# host-bound loop on an H200: reading every token back at the call cost 519 us a step against 561 us when every
# one was offloaded (run 51), and 0.880x plain tokens/s against 0.804x (run 53); with a 40 us look 3-64 of 450
# readbacks a round still missed and were offloaded (0.859x). An offloaded readback costs the host some 60 us
# more than one read at the call, so a look that long still pays.
DRAIN_LOOK_S = 100e-6
MAX_DRAIN_SKIPS = 64
_MAX_MISSES_COUNTED = 6  # 2 ** 6 = MAX_DRAIN_SKIPS


def _lane() -> _Lane:
    lane = _LANE[0]
    if lane is None:
        lane = _LANE[0] = _Lane()
    return lane


def in_dual_level() -> bool:
    """Whether a forward-mode AD level is open: a tensor may then carry a tangent (its ``requires_grad`` False) that
    only torch's own copy carries over, so no copy is inlined or offloaded. The level is a module global of torch
    (-1: none), read at each call."""
    lane = _LANE[0] or _lane()
    return lane.forward_ad._current_level >= 0


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


def to(self: Any, where: Any, max_staged_bytes: int, inline_max_bytes: int) -> Any:
    """``self.to(where, non_blocking=True)`` through the lane, or None (nothing done) if the lane does not take it.

    The caller has checked the call's form (two positional arguments, ``non_blocking=True`` alone as a keyword)
    and that dynamo is not tracing.
    """
    lane = _LANE[0] or _lane()
    if (not lane.ready or type(self) is not lane.tensor or lane.has_override(self) or lane.dispatch_depth()
            or lane.functorch_peek() is not None or lane.functorch_wrapped(self)
            or lane.forward_ad._current_level >= 0):
        return None
    if type(where) is lane.device_type:
        device = where
    else:
        device = lane.devices.get(where) if type(where) is str else None
        if device is None:
            device = _device(lane, where)
    if device is None or _streams.CAPTURES[0]:
        return None
    # A ZeroTensor has no memory (its data pointer is 0), and _offload and _stage move bytes by pointer: torch's
    # own copy (the general path routes it so). One C call on each path, asked once the call's checks have let it
    # through, at the lane's one entry into either.
    if self.is_cuda:
        if device.type != "cpu" or self._is_zerotensor():
            return None
        return _offload(lane, self, device, max_staged_bytes)
    if device.type == "cuda" and self.is_cpu and not self._is_zerotensor():
        return _stage(lane, self, device, max_staged_bytes, inline_max_bytes)
    return None


def _plain_block(lane: _Lane, t: Any, max_staged_bytes: int) -> bool:
    """Whether ``t`` is one dense block the lane may move as it lies (what the general path routes the same way),
    with memory of its own: a ZeroTensor's data pointer is 0 (asked last, after the checks that refuse cheaper)."""
    return (t.layout is lane.strided and not t.is_nested and not t.is_quantized and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and t.nbytes <= max_staged_bytes and not t._is_zerotensor())


def _offload(lane: _Lane, self: Any, device: Any, max_staged_bytes: int) -> Any:
    """``self.to("cpu", non_blocking=True)`` offloaded, if the current stream of ``self``'s GPU is a D2H stream
    (``self`` is not a ZeroTensor: :func:`to` checked).

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
    # _plain_block, inline (this is the readback of every decode step); to() has refused a ZeroTensor
    if (record is None or self.layout is not lane.strided or self.is_nested or self.is_quantized
            or not self.is_contiguous() or self.is_conj() or self.is_neg() or self.nbytes > max_staged_bytes):
        return None
    if self.requires_grad and lane.grad_enabled():
        return None  # torch records the copy for autograd: its own copy (general path: "autograd")
    if _helper.ENABLED[0]:
        helper = _helper.for_device(index)
        if helper is not None and self.nbytes <= helper.slot_bytes:
            dst = _d2h.offload_to_helper(record, self, index, helper)
            if dst is not None:
                COUNTERS.add("offloaded")
                COUNTERS.add("to_helper")
                return dst
    # A small readback is read back at the call if nothing offloaded from this stream is unfinished (no copy pending
    # anywhere, the common case, reads one integer) and the stream has drained or drains within the look.
    dst = None
    if self.nbytes < READ_BACK_NOW_BYTES:
        if _emulation._installed or _raw.COPIES_FINISH_AT_CALL[0]:
            # The host waits for the copy (CC, or its emulation): the look, unless timing this loop both ways says
            # offloading without it is faster (._readback_choice). The result is made before the look, so only
            # the copy's two driver calls follow the drain (:func:`_read_back_into`).
            if not record.choice.offload() and (not _d2h._PENDING[0] or record.last_job <= record.worker.completed):
                dst = lane.empty_strided(self.shape, self.stride(), dtype=self.dtype, pin_memory=True)
                done = _read_back_into(lane, dst, self, device, index, record)
                if done is not None:
                    return done
        elif ((not _d2h._PENDING[0] or record.last_job <= record.worker.completed)
              and (lane.stream_query(record.stream) or _drains_soon(lane, record))):
            return _read_back_now(lane, self, device, record)
    if dst is None:
        dst = _d2h.pinned_block(self, self.dtype)
    if not _d2h.offload_block(record, dst, self, index):
        return None  # no room for the snapshot, or offloading is closed: the general path runs torch's own
    COUNTERS.add("offloaded")
    return dst


def _drains_soon(lane: _Lane, record: Any) -> bool:
    """Whether D2H stream ``record.stream``, found busy by the caller's query, drains within :data:`DRAIN_LOOK_S` of
    looking (host only: queries, the GIL held; never longer than that).

    A decode loop at batch 1 reads its token back just behind its last launch: the GPU is a few kernels behind the
    host, and the stream drains within microseconds. A small copy then costs its transfer alone as torch's own
    (:func:`_read_back_now`), well under what offloading it costs the host (the offload, and the job later, which
    also waits for the transfer). Behind long GPU work the look times out and the copy is offloaded; the next looks
    are skipped, for twice as many readbacks after each miss in a row (up to :data:`MAX_DRAIN_SKIPS`), so a loop
    whose readback always waits behind its step pays the look once in that many. A capture another thread begins
    (``CUDAGraph.capture_begin`` notes it before it begins) ends the look before the next query: in torch's global
    capture mode a query from any thread would invalidate it.
    """
    stream = record.stream
    query = lane.stream_query
    if record.drain_skips:
        record.drain_skips -= 1
        return False
    deadline = _clock() + DRAIN_LOOK_S
    captures = _streams.CAPTURES
    while _clock() < deadline:
        if captures[0]:
            return False  # a capture began on another thread: no more queries (the offload then refuses too)
        if query(stream):
            record.drain_misses = 0
            return True
    misses = record.drain_misses = min(record.drain_misses + 1, _MAX_MISSES_COUNTED)
    record.drain_skips = min(1 << misses, MAX_DRAIN_SKIPS)
    return False


def _read_back_into(lane: _Lane, dst: Any, src: Any, device: Any, index: int, record: Any) -> Any:
    """Where the host waits for a D2H copy anyway (CC, or its emulation): copy small ``src`` into the fresh pinned
    ``dst`` at the call if D2H stream ``record.stream`` has drained or drains within the look, and return ``dst``;
    None (nothing enqueued) if it does not drain: the caller offloads into ``dst``.

    What torch's own copy costs there, less its serialized part: torch's ``.to()`` allocates its result and reads
    the call only once the stream has drained (the look), while here the result and the context check come
    first, so the GPU's last kernels finish meanwhile, and after the drain come only the copy's driver calls
    (:func:`._raw.copy_to_host_now`: the copy, and when emulated the wait CC makes). Its bytes are those torch's
    copy reads on ``record.stream`` at the call: nothing is queued there ahead of it, and nothing can be queued
    behind it before it finishes (it has when this returns). ``dst`` is pinned, with ``src``'s shape and strides and
    version 0, as torch's result is. A copy call that fails is torch's own instead, which raises torch's own
    error if there is one; after any failure ``dst`` is kept for good (:func:`._raw.park`), since a copy may
    have been enqueued into it. Counted in ``left_alone["idle_stream"]``, as torch's copy there is.
    """
    pushed = _raw.enter_context(index)
    try:
        if not (lane.stream_query(record.stream) or _drains_soon(lane, record)):
            return None
        try:
            _raw.copy_to_host_now(dst.data_ptr(), src.data_ptr(), src.nbytes, record.stream.cuda_stream)
        except BaseException as err:
            # A copy may be enqueued into dst (a failed wait; an interrupt between the two calls; a blocking copy
            # call that failed): torch's host allocator knows no event for it, so dst is never given back.
            _raw.park(dst)
            if not isinstance(err, CudaError) or err.call != "cuMemcpyDtoHAsync":
                raise  # the wait failed (a GPU error, as torch's own wait would raise), or an interrupt
            return _read_back_now(lane, src, device, record)  # torch's own copy, and its own error if any
    finally:
        if pushed:
            _raw.leave_context()
    COUNTERS.read_back_at_call(_emulation._installed)
    return dst


def _read_back_now(lane: _Lane, self: Any, device: Any, record: Any) -> Any:
    """torch's own ``self.to("cpu", non_blocking=True)`` (under :data:`READ_BACK_NOW_BYTES`) on D2H stream
    ``record.stream``, which has nothing queued and no offloaded copy pending: under CC the host then waits for the
    transfer alone.

    That is what an offloaded small copy costs too (its job runs on the thread that waits for it, :mod:`._worker`),
    without the offload's own cost: the snapshot, the ready event, the job, the note. A decode loop reads its token
    back when the compute stream has just drained (batch 1: the host is the bottleneck), so this is its common case.
    Counted in ``left_alone["idle_stream"]``. The host then waits as CC would, if it is emulated; under CC (NVML said
    so at ``install()``) the copy has finished; otherwise it may still be in flight, so it is noted for the uploads
    that read that host memory (:mod:`._host_writes`).
    """
    COUNTERS.left_alone("idle_stream")
    stream = record.stream
    result = lane.torch_to(self, device, non_blocking=True)
    if _emulation.is_emulating():
        _streams.wait_stream_raw(stream)  # the wait CC makes (what _emulation.wait_after_copy_on makes)
        COUNTERS.add("emulated_waits")
    elif not _host_writes.COPIES_FINISH_AT_CALL[0]:
        _host_writes.note_plain_d2h(result, stream)
    return result


def _stage(lane: _Lane, self: Any, device: Any, max_staged_bytes: int, inline_max_bytes: int) -> Any:
    """``self.to(device, non_blocking=True)`` for a host tensor (not a ZeroTensor: :func:`to` checked): inlined (at
    most ``inline_max_bytes``), torch's own on an idle current stream, else staged; or None."""
    index = device.index
    current_device = lane.current_device()
    if index is None:
        index = current_device
    if (index != current_device or lane.capturing() or self.layout is not lane.strided or self.is_nested
            or self.is_quantized or not self.is_contiguous() or self.is_conj() or self.is_neg()
            or self.nbytes > max_staged_bytes):  # _plain_block, inline (the upload of every decode step)
        return None
    if ((_d2h._PENDING[0] or _d2h.UNRAISED[0]) and _d2h._streams_by_key
            and (index, lane.raw_stream(index)) in _d2h._streams_by_key):
        return None  # a D2H stream is current: the general path waits for its offloaded copies (raises a failure)
    if self.requires_grad and lane.grad_enabled():
        return None  # torch records the copy for autograd: the general path stages torch's own copy
    nbytes = self.nbytes
    if nbytes <= inline_max_bytes and (not _host_writes.NOTED_STARTS or _host_writes.settle_for_host_read(self)):
        entries = _inline_h2d.functions(index)
        if entries is not None:
            landed = lane.empty_strided(self.shape, self.stride(), dtype=self.dtype, device=device)
            if _inline(lane, landed, self, index, nbytes, entries):
                return landed
    current = _streams.current_stream(index)
    if lane.stream_query(current):
        # Nothing is queued on the current stream: staging would hide nothing (under CC torch's own copy waits
        # for the transfer alone) and only add its own cost. torch's copy, on the current stream, after the
        # offloaded copies still writing this host memory (the host waits for those, as a staged copy does);
        # then the wait CC would make, if it is emulated (as a staged copy does: not through the emulator's layer,
        # whose reading of the call is no part of what CC costs).
        if _host_writes.NOTED_STARTS:
            _host_writes.order_after_pending_writes(current, self)
        COUNTERS.left_alone("idle_stream")
        landed = lane.torch_to(self, device, non_blocking=True)
        if _emulation._installed:  # (_emulation.wait_after_copy_on, inline)
            _streams.wait_stream_raw(current)
            COUNTERS.add("emulated_waits")
        return landed
    COUNTERS.add("staged")
    return _staging.land(self, index, current=current)


def _inline(lane: _Lane, dst: Any, src: Any, index: int, nbytes: int, entries: tuple) -> bool:
    """Write host ``src``'s bytes, read now, into device ``dst`` (the same layout) by one kernel on the current stream
    whose parameters carry them (:mod:`._inline_h2d`). Nothing blocks, under CC or not.

    current : ... [K: dst <- bytes] (the caller's next work)

    No D2H copy syncless noted is still writing ``src`` (the caller settled it), so its bytes now are the bytes
    torch's copy would read in stream order. Returns False, having enqueued nothing, if the launch failed (the
    kernel is then given up on that GPU, :func:`._inline_h2d.give_up`): the caller routes the copy as before.
    """
    if nbytes:
        pushed = _raw.enter_context(index)
        try:
            _inline_h2d.launch(entries, dst.data_ptr(), src.data_ptr(), nbytes, lane.raw_stream(index), index)
        except CudaError as err:
            _inline_h2d.give_up(index, err)  # nothing was enqueued: the caller stages this copy, and later ones
            return False
        finally:
            if pushed:
                _raw.leave_context()
    COUNTERS.add("inlined")
    return True


def copy_into(dst: Any, src: Any, inline_max_bytes: int, max_staged_bytes: int) -> bool:
    """``dst.copy_(src, non_blocking=True)`` of host ``src`` into CUDA ``dst`` as one inline kernel, if it is a small
    plain upload (same dtype and shape, both contiguous, neither a ZeroTensor, nothing for autograd to record);
    return whether it was done (False: nothing was, the caller routes the copy, and torch zero-fills ``dst`` from
    a ZeroTensor, or refuses to write one).

    The caller (the shim's ``copy_``) has checked the call's form, overrides, modes and compiling, and settled
    the D2H stream. Enqueues on ``dst``'s current stream, where torch's copy goes; bumps ``dst``'s version
    counter once, as torch's copy does; does not block the host.
    """
    lane = _LANE[0] or _lane()
    if (not lane.ready or type(dst) is not lane.tensor or type(src) is not lane.tensor or not src.is_cpu
            or _streams.CAPTURES[0] or lane.forward_ad._current_level >= 0):
        return False
    # One dense block each, within both bounds (_plain_block asks the layout before nbytes, which a sparse or nested
    # tensor refuses), then the same dtype and shape.
    limit = min(inline_max_bytes, max_staged_bytes)
    if not (_plain_block(lane, src, limit) and _plain_block(lane, dst, limit)):
        return False
    if dst.dtype != src.dtype or dst.shape != src.shape:
        return False
    index = dst.get_device()
    if index != lane.current_device() or lane.capturing():
        return False
    if (dst.requires_grad or src.requires_grad) and lane.grad_enabled():
        return False  # torch records the copy for autograd (or refuses a leaf): the general path
    if dst.is_inference() and not lane.inference_mode():
        return False  # torch refuses it at the call: the general path passes the call on
    if not _host_writes.settle_for_host_read(src):
        return False
    entries = _inline_h2d.functions(index)
    if entries is None:
        return False
    if not _inline(lane, dst, src, index, src.nbytes, entries):
        return False
    _d2h._bump_version(dst)
    return True

"""The CC shim's ``Tensor.to/cuda/copy_`` layer, and install/uninstall.

Each wrapper takes ``*args, **kwargs`` and passes them on untouched
(:mod:`._layers`), so torch parses every call itself; a blocking call, the
common case, goes to the function beneath its own layer (``next_fn``) at
once. For a ``non_blocking`` one it gathers the facts
(:class:`._routing.CopyFacts`), asks :func:`._routing.route_copy` what to
do, and either performs the copy through :mod:`._staging`/:mod:`._d2h` or
calls ``next_fn`` unchanged. The shim's own copies never pass through the
hidden-sync detector (above); a staged H2D calls torch's own method and asks
the CC emulator for the wait the driver would make
(:func:`._emulation.wait_after_copy_on`), the D2H worker's copy goes through
the functions beneath the shim's layer, the emulator's included.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from syncless._core import config, patching
from syncless._core.compiling import is_compiling
from syncless._core.layouts import broadcasts_to
from syncless._core.tensor_calls import maybe_non_blocking_to, parse_to, read_copy, read_cuda, reads_as_cuda_device
from syncless.cc import _d2h, _emulation, _fast, _helper, _host_writes, _routing, _staging, _streams, _sync_patches
from syncless.cc._layers import SHIM_KEY, SYNCING_ATTRS, TENSOR_ATTRS, call_for_routing, call_for_waiting
from syncless.cc._stats import COUNTERS

_log = logging.getLogger(__name__)

_lock = threading.Lock()


class _State:
    installed = False
    max_staged_bytes = 64 << 20
    inline_max_bytes = 4080  # SYNCLESS_CC_INLINE_MAX_BYTES, read at install (._inline_h2d)


_STATE = _State()


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _strided(*tensors: Any) -> bool:
    import torch

    strided = torch.strided
    for t in tensors:  # a loop, not all(<generator>): this runs on every routed copy
        # Quantized tensors are strided but have no pinned empty_strided (issue 27 item 6): torch's own copy. So
        # is a ZeroTensor, strided and contiguous but without memory (data pointer 0): torch's copy reads none of
        # it (or refuses to write it), while a staged or offloaded one would read its storage (asked last: a C call
        # every routed copy makes, after the cheap refusals).
        if t.layout != strided or t.is_nested or t.is_quantized or t._is_zerotensor():
            return False
    return True


def _d2h_record(src: Any):
    if not _d2h.has_streams():
        return None
    return _d2h.lookup(_streams.current_stream(src.device.index))


def _refuses_inplace(dst: Any) -> bool:
    """Whether torch refuses an in-place write of ``dst`` here: an inference tensor outside inference mode."""
    import torch

    return dst.is_inference() and not torch.is_inference_mode_enabled()


def _drops_imaginary(src: Any, dst: Any, dst_dtype: Any) -> bool:
    """Whether a copy of ``src`` into ``dst`` (or a new tensor of ``dst_dtype``) drops an imaginary part."""
    if not src.is_complex():
        return False
    if dst is not None:
        return not dst.is_complex()
    return dst_dtype is not None and not dst_dtype.is_complex


def _decide(src: Any, dst_type: str, index: int | None, *, into_existing: bool, registered: bool,
            dtype_changes: bool, autograd: bool, dst: Any = None, dst_dtype: Any = None,
            src_type: str | None = None) -> tuple[str, str, Any]:
    """Gather the facts of one ``non_blocking`` copy and route it; count left-alone copies.

    ``dst``: the destination of a ``copy_``; ``dst_dtype``: the dtype asked of a ``.to`` (None: unchanged);
    ``src_type``: ``src.device.type`` where the caller has it already.
    """
    if src_type is None:
        src_type = src.device.type
    record = None
    capturing = False
    if (src_type == "cuda") != (dst_type == "cuda"):
        capturing = _streams.any_current_capture(index)
        if src_type == "cuda":
            record = _d2h_record(src)
    facts = _routing.CopyFacts(
        src_type=src_type,
        dst_type=dst_type,
        non_blocking=True,
        nbytes=_nbytes(src),
        into_existing=into_existing,
        registered_target=registered,
        dtype_changes=dtype_changes,
        capturing=capturing,
        on_d2h_stream=record is not None,
        strided=_strided(src) if dst is None else _strided(src, dst),
        autograd=autograd,
        dual_level=dst_type == "cuda" and _fast.in_dual_level(),
        pageable_target=record is not None and dst is not None and not dst.is_pinned(),
        noncontiguous_target=record is not None and dst is not None and not dst.is_contiguous(),
        inference_target=record is not None and dst is not None and _refuses_inplace(dst),
        complex_to_real=record is not None and _drops_imaginary(src, dst, dst_dtype),
    )
    route, reason = _routing.route_copy(facts, _STATE.max_staged_bytes)
    if route == _routing.ORIGINAL:
        COUNTERS.left_alone(reason)
    return route, reason, record


def _fills_on_the_host(result: Any, src: Any) -> bool:
    """Whether torch's ``src.to("cpu", ..., non_blocking=True)`` writes ``result`` on the host before it returns.

    torch moves a block as it lies (in stream order) only when ``result`` is contiguous, or has ``src``'s dtype
    and strides; otherwise (a channels_last bf16 source to fp32, say) it copies into a pageable contiguous
    temporary and fills the non-contiguous pinned result from it on the host, so a read right after the call
    sees the data, and the copy is left to torch (``noncontiguous_target``), as for an existing target.
    """
    if result.is_contiguous():
        return False
    return result.dtype != src.dtype or result.stride() != src.stride()


def _check_broadcastable(dst: Any, src: Any) -> None:
    """Raise ``RuntimeError`` (as torch's own ``copy_`` would) if ``src`` cannot fill ``dst``.

    Plain Python on the shapes (:func:`syncless._core.layouts.broadcasts_to`: no sympy import).
    """
    if not broadcasts_to(tuple(src.shape), tuple(dst.shape)):
        raise RuntimeError(
            f"copy_: source of shape {tuple(src.shape)} cannot be copied into a tensor of shape {tuple(dst.shape)}"
        )


def _note_plain_d2h(dst: Any, src: Any) -> None:
    """After torch's own ``non_blocking`` D2H into ``dst``: note it, so a staged H2D of ``dst`` waits for it.

    Skipped while this thread's stream is capturing (the copy is then a graph node, not work on the stream); a
    capture on another thread does not make this thread's copy any less real.
    """
    index = src.device.index
    if dst is src or _streams.is_current_stream_capturing(index):
        return
    _host_writes.note_plain_d2h(dst, _streams.current_stream(index))


def _present_cuda_index(device: Any) -> int | None:
    """The index of CUDA ``device`` (None: the current GPU) if this process has that GPU, else None.

    A copy to a GPU torch cannot reach (a CPU-only build, an index past the last GPU) is not routed: it goes
    on as given and torch raises its own error for it.
    """
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return None
    index = _streams.device_index(device)
    return index if 0 <= index < count else None


def _wrap_to(next_to):
    import torch

    # torch's own predicate, called directly (dynamo folds it wherever it is referenced from): one Python call
    # fewer than syncless._core.compiling.is_compiling on every .to() of the program.
    compiling = torch.compiler.is_compiling

    def to(*args, **kwargs):
        # Takes and passes on exactly what the caller gave (see ._layers); reads only torch's own forms.
        if compiling() or not args:
            return next_to(*args, **kwargs)
        if len(args) == 2 and len(kwargs) == 1 and kwargs.get("non_blocking") is True:
            # x.to(device, non_blocking=True): the decode loop's upload and readback (the fast lane, ._fast)
            result = _fast.to(args[0], args[1], _STATE.max_staged_bytes, _STATE.inline_max_bytes)
            if result is not None:
                return result
        rest = args[1:]
        if not maybe_non_blocking_to(rest, kwargs):  # the hot path: reads no tensor
            if _d2h.busy() and call_for_waiting(args, kwargs):
                _settle_for_to(args[0], rest, kwargs)
            return next_to(*args, **kwargs)
        if call_for_routing(args, kwargs) is None:
            if _d2h.busy() and call_for_waiting(args, kwargs):
                _settle_for_to(args[0], rest, kwargs)  # a dispatch mode's copy: after D's offloaded ones
            return next_to(*args, **kwargs)  # torch refuses the call, or an override takes it
        self = args[0]
        try:
            device, dtype, non_blocking, memory_format = parse_to(rest, kwargs)
        except (TypeError, RuntimeError, ValueError):
            return next_to(*args, **kwargs)  # let torch raise its own error for a bad call
        if device is None or not non_blocking:
            _settle_for_to(self, rest, kwargs)
            return next_to(*args, **kwargs)
        src_device = self.device
        src_type, dst_type = src_device.type, device.type
        index = None
        if dst_type == "cuda":
            index = _present_cuda_index(device)
            if index is None:
                return next_to(*args, **kwargs)  # torch raises its own error
        elif src_type == "cuda":
            index = src_device.index
        # (a forward-mode tangent is carried only by torch's own copy)
        autograd = (self.requires_grad and torch.is_grad_enabled()) or _fast.in_dual_level()
        route, _, record = _decide(self, dst_type, index, into_existing=False, registered=False,
                                   dtype_changes=dtype is not None and dtype != self.dtype, autograd=autograd,
                                   dst_dtype=dtype, src_type=src_type)
        if route != _routing.OFFLOAD and _touches_host(src_type, dst_type):
            _settle_d2h_stream(index)
        if route == _routing.ORIGINAL and dst_type == "cuda":
            _wait_for_writes_into(self)  # torch's own upload reads the host memory
        if route == _routing.STAGE_FRESH:
            COUNTERS.add("staged")
            return _staging.land_converted(self, index, dtype, memory_format)
        if route == _routing.OFFLOAD:
            dst = _d2h.pinned_like(self, dtype, memory_format)
            if _fills_on_the_host(dst, self):
                COUNTERS.left_alone("noncontiguous_target")
            elif _d2h.offload(record, dst, self, ".to('cpu', non_blocking=True)", into_existing=False):
                COUNTERS.add("offloaded")
                return dst
            # torch's own copy, after the queued ones (no room for the snapshot, or torch fills it on the host)
            _settle_d2h_stream(index)
            route = _routing.ORIGINAL
        result = next_to(*args, **kwargs)
        if route == _routing.ORIGINAL and dst_type == "cpu" and src_type == "cuda":
            _note_plain_d2h(result, self)
        return result

    return to


def _wrap_cuda(next_cuda):
    import torch

    def cuda(*args, **kwargs):
        # Takes and passes on exactly what the caller gave (see ._layers); reads only torch's own forms
        # (the deprecated ``async=`` too, which is never routed).
        read = read_cuda(args[1:], kwargs, deprecated_async=True) if args else None
        if read is None:
            return next_cuda(*args, **kwargs)  # torch refuses the call
        device, non_blocking, memory_format = read
        if non_blocking is not True or "async" in kwargs or is_compiling():
            # is_compiling() is asked before the pending count is read: dynamo guards on what traced code reads,
            # and a count that changes per call recompiled the frame until it fell back to eager (issue 33 item 1)
            if (not is_compiling() and _d2h.busy()
                    and call_for_waiting(args, kwargs) and args[0].device.type != "cuda"):
                _settle_for_cuda(device)
                _wait_for_writes_into(args[0])
            return next_cuda(*args, **kwargs)
        if call_for_routing(args, kwargs) is None:
            if _d2h.busy() and call_for_waiting(args, kwargs) and args[0].device.type != "cuda":
                _settle_for_cuda(device)  # a dispatch mode's copy: after D's offloaded ones
            return next_cuda(*args, **kwargs)  # torch refuses the call, or an override takes it
        self = args[0]
        if self.device.type == "cuda":
            COUNTERS.left_alone("device_to_device")
            return next_cuda(*args, **kwargs)
        if not reads_as_cuda_device(device) or (
            memory_format is not None and not isinstance(memory_format, torch.memory_format)
        ):
            return next_cuda(*args, **kwargs)  # torch raises its own error
        index = _present_cuda_index(device)
        if index is None:
            return next_cuda(*args, **kwargs)  # torch raises its own error
        route, _, _ = _decide(self, "cuda", index, into_existing=False, registered=False, dtype_changes=False,
                              autograd=False)
        if route != _routing.STAGE_FRESH:
            _settle_d2h_stream(index)
            _wait_for_writes_into(self)  # torch's own upload reads the host memory
            return next_cuda(*args, **kwargs)
        COUNTERS.add("staged")
        if memory_format is not None and memory_format is not torch.preserve_format:
            return _staging.land_converted(self, index, None, memory_format)
        return _staging.land(self, index, how="cuda")

    return cuda


def _settle_d2h_stream(index: int | None) -> None:
    """Before a copy that is not offloaded: if it goes on a D2H stream of GPU ``index``, wait for its offloaded copies.

    torch would run such a copy on the D2H stream after the copies issued there before it (a read of the
    host memory they write, an overwrite of their source); the offloaded ones are not on the stream yet, so
    the host waits for them (:mod:`._d2h`), and a failure among them that this thread has not had is raised,
    whether or not they have finished (a failed copy that had finished was not raised here, found in review).
    Costs two integer compares while no offloaded copy is pending and no failure is kept.
    """
    if index is None or not _d2h.busy() or not _d2h.has_streams():
        return
    record = _d2h.lookup(_streams.current_stream(index))
    if record is not None:
        _d2h.wait_for_stream(record)


def _touches_host(a_type: str, b_type: str) -> bool:
    """Whether a copy between devices of these types reads or writes host memory (one side CUDA, one not).

    Only such a copy waits for offloaded D2H copies when issued on a D2H stream: they write host memory, and
    torch would run the copy after them on that stream (and a blocking D2H synchronizes the stream). GPU-only
    work needs no wait: each offloaded copy reads a snapshot of its own (:mod:`._d2h`).
    """
    return (a_type == "cuda") != (b_type == "cuda")


def _settle_for_cuda(device: Any) -> None:
    """:func:`_settle_d2h_stream` for a host tensor's ``.cuda(device)`` that is not staged."""
    if not _d2h.busy() or not reads_as_cuda_device(device):
        return
    try:
        index = _streams.device_index(device)
    except (TypeError, RuntimeError, ValueError):
        return  # torch refuses the call
    _settle_d2h_stream(index)


def _wait_for_writes_into(host: Any) -> None:
    """Before torch's own copy reads or writes host tensor ``host``: the host waits for the offloaded copies still
    writing its memory (and raises a failure among them), as a staged upload does
    (:func:`._host_writes.wait_for_offloaded_writes`). Found in review: an upload the shim left to torch (a
    blocking one, one too large to stage) read the memory before the offloaded copy had written it; a copy into
    it would be overwritten by the offloaded one, issued before it. Two integer reads while no offloaded copy is
    pending and no failure is kept: one that finished without a failure leaves nothing to wait for."""
    if not (_d2h.busy() and _host_writes.NOTED_STARTS):
        return
    import torch
    # A __torch_dispatch__ tensor (a wrapper, a fake one) has no host memory of its own that a copy was noted in.
    # While this thread's stream captures, torch's copy is a graph node that reads the memory at each replay, not
    # now. Another thread's capture does not matter: while one is open nothing is pending, and while its
    # capture_begin still drains the offloaded copies, this wait must wait for them too (found in review: skipping
    # on any capture let an upload read memory a copy had not yet written).
    if type(host).__torch_dispatch__ is torch.Tensor.__torch_dispatch__ and not _streams.this_thread_captures():
        _host_writes.wait_for_offloaded_writes(host)


def _plain_same_side(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are plain tensors both on a GPU or both off one (a copy between them touches no host
    memory an offloaded copy writes): two type checks and two attribute reads, before the call is read in full."""
    import torch

    tensor = torch.Tensor
    return type(a) is tensor and type(b) is tensor and a.is_cuda == b.is_cuda


def _cuda_index(*tensors: Any) -> int | None:
    """The GPU of the first CUDA tensor among ``tensors`` (None: none is)."""
    import torch

    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return t.device.index
    return None


def _settle_for_to(self: Any, args: tuple, kwargs: dict) -> None:
    """:func:`_settle_d2h_stream` for a ``Tensor.to`` that is not offloaded and moves bytes to or from the host;
    before an upload, also the offloaded copies still writing its host memory (:func:`_wait_for_writes_into`).

    A ``.to`` that stays on the GPU (a cast, another GPU) waits for nothing: an offloaded copy reads only its
    own snapshot and writes only host memory, so GPU work queued after it cannot disturb it (:mod:`._d2h`).
    """
    if not _d2h.busy():
        return
    try:
        device = parse_to(args, kwargs)[0]
    except (TypeError, RuntimeError, ValueError):
        return  # torch refuses the call
    if device is None:
        return  # a cast on the tensor's own device
    if self.device.type == "cuda":
        if device.type != "cuda":
            _settle_d2h_stream(self.device.index)
    elif device.type == "cuda":
        _settle_d2h_stream(_streams.device_index(device))
        _wait_for_writes_into(self)  # torch's own upload reads the host memory


def _wrap_copy(next_copy):
    import torch

    compiling = torch.compiler.is_compiling  # called directly: see _wrap_to

    def copy_(*args, **kwargs):
        # Takes and passes on exactly what the caller gave (see ._layers); reads only torch's own forms
        # (the deprecated ``async=`` too, which is never routed).
        if len(args) == 2 and not kwargs and (compiling() or not (_d2h._PENDING[0] or _d2h.UNRAISED[0])):
            return next_copy(*args)  # dst.copy_(src): blocking, no offloaded copy to settle (a decode step's D2D)
        read = read_copy(args[1:], kwargs, deprecated_async=True) if args else None
        if read is None:
            return next_copy(*args, **kwargs)  # torch refuses the call
        other, non_blocking = read
        if non_blocking is not True or "async" in kwargs:
            # The hot path: a blocking copy goes straight beneath, unless D2H copies are still queued (asked
            # after is_compiling(), which dynamo folds: see _wrap_cuda).
            if (not is_compiling() and _d2h.busy()
                    and not _plain_same_side(args[0], other) and call_for_waiting(args, kwargs)
                    and isinstance(other, torch.Tensor) and _touches_host(args[0].device.type, other.device.type)):
                _settle_d2h_stream(_cuda_index(args[0], other))
                _wait_for_writes_into(other if args[0].device.type == "cuda" else args[0])  # the host side
            return next_copy(*args, **kwargs)
        if is_compiling() or not isinstance(other, torch.Tensor):
            return next_copy(*args, **kwargs)  # compiling, or torch refuses the call
        if call_for_routing(args, kwargs) is None:
            if (_d2h.busy() and call_for_waiting(args, kwargs)
                    and _touches_host(args[0].device.type, other.device.type)):
                _settle_d2h_stream(_cuda_index(args[0], other))  # a dispatch mode's copy: after D's offloaded ones
            return next_copy(*args, **kwargs)  # an override takes it, or a dispatch mode sees it
        self, src = args[0], other
        if self.device.type == "cuda" and src.device.type != "cuda":
            _settle_d2h_stream(self.device.index)  # an H2D reads host memory an offloaded copy may still write
            index = self.device.index
            registered = _staging.is_registered_target(self)
            if not registered and _fast.copy_into(self, src, _STATE.inline_max_bytes, _STATE.max_staged_bytes):
                return self  # a small upload, written by one kernel on the current stream (._inline_h2d)
            route, _, _ = _decide(src, "cuda", index, into_existing=True, registered=registered,
                                  dtype_changes=self.dtype != src.dtype, autograd=False, dst=self)
            if route == _routing.IN_PLACE:
                COUNTERS.add("in_place")
                return _staging.copy_in_place(self, src)
            if route == _routing.STAGE_INTO:
                COUNTERS.add("staged")
                return _staging.stage_into(self, src, next_copy)
            _wait_for_writes_into(src)  # torch's own upload reads the host memory
            return next_copy(*args, **kwargs)
        # (a forward-mode tangent is carried only by torch's own copy)
        autograd = ((self.requires_grad or src.requires_grad) and torch.is_grad_enabled()) or _fast.in_dual_level()
        route, _, record = _decide(src, self.device.type, src.device.index if src.device.type == "cuda" else None,
                                   into_existing=True, registered=False, dtype_changes=self.dtype != src.dtype,
                                   autograd=autograd, dst=self)
        if route == _routing.OFFLOAD:
            _check_broadcastable(self, src)  # refuse now what the worker's copy would fail on later
            if _d2h.offload(record, self, src, "copy_(non_blocking=True)", into_existing=True):
                COUNTERS.add("offloaded")
                return self
            # No room for the snapshot: torch's own copy (below), after the queued ones.
        if _touches_host(self.device.type, src.device.type):
            _settle_d2h_stream(_cuda_index(src))
            if self.device.type == "cpu":
                _wait_for_writes_into(self)  # torch's own copy writes it: after the offloaded one issued before
        result = next_copy(*args, **kwargs)
        if self.device.type == "cpu" and src.device.type == "cuda":
            _note_plain_d2h(self, src)
        return result

    return copy_


def _wrap_syncing(next_fn):
    """Front a host-blocking read (``Tensor.cpu``, ``item``, ``tolist``): on a D2H stream, its offloaded copies first.

    torch runs such a read on the current stream and returns once that stream has reached it, so everything
    queued there before, an offloaded copy included, has finished; the program may then read that copy's host
    memory. The offloaded copies are not on the stream, so the host waits for them (:mod:`._d2h`). Costs one
    integer compare while no offloaded copy is pending; otherwise passes the call on untouched.
    """
    def syncing(*args, **kwargs):
        if not is_compiling() and _d2h.busy():  # is_compiling() first: see _wrap_cuda
            if call_for_waiting(args, kwargs) and args[0].device.type == "cuda":
                _settle_d2h_stream(args[0].device.index)
        return next_fn(*args, **kwargs)

    return syncing


_WRAPPERS = {"to": _wrap_to, "cuda": _wrap_cuda, "copy_": _wrap_copy}
_WRAPPERS.update({name: _wrap_syncing for name in SYNCING_ATTRS})


def install_shim(max_staged_bytes: int | None = None) -> bool:
    """Add the shim's layers (tensor copies and synchronization); return False if already installed."""
    import torch

    limit = config.resolve("SYNCLESS_CC_MAX_STAGED_BYTES", max_staged_bytes)
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"max_staged_bytes must be an int, got {type(limit).__name__}")
    if limit < 0:
        raise ValueError(f"max_staged_bytes must be >= 0, got {limit}")
    inline_limit = config.resolve("SYNCLESS_CC_INLINE_MAX_BYTES")  # the registry bounds it (ConfigError)
    use_helper = config.resolve("SYNCLESS_CC_D2H_HELPER")
    with _lock:
        _helper.ENABLED[0] = use_helper
        _STATE.max_staged_bytes = limit
        _STATE.inline_max_bytes = inline_limit
        if _STATE.installed:
            return False
        _d2h.restart_workers()
        for name in TENSOR_ATTRS + SYNCING_ATTRS:
            patching.add_layer(torch.Tensor, name, SHIM_KEY, patching.RANK_CC_SHIM, _WRAPPERS[name])
        _sync_patches.install_sync_patches()
        _d2h.resume_offloading()  # only now: every offloaded copy from here on has patched syncs to cover it
        _STATE.installed = True
        return True


def uninstall_all(timeout_s: float = 60.0) -> None:
    """Finish queued D2H copies (at most ``timeout_s``), then remove the shim's and the emulator's layers.

    Raises:
        D2HCopyError: a queued copy failed (raised after everything is restored).
        D2HTimeoutError: the queued copies did not finish in time (raised after everything is restored).
    """
    import torch

    with _lock:
        pending_error: BaseException | None = None
        # A thread inside a wrapper right now must not offload behind the drain below (its later synchronize
        # would be torch's own, which does not wait for the worker): from here it runs torch's own copy.
        _d2h.stop_offloading()
        try:
            _d2h.drain(timeout_s)
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the originals are back
            pending_error = err
        if _STATE.installed:
            for name in TENSOR_ATTRS + SYNCING_ATTRS:
                patching.remove_layer(torch.Tensor, name, SHIM_KEY)
            _sync_patches.uninstall_sync_patches()
            _STATE.installed = False
        _emulation.uninstall_emulation()
        _helper.ENABLED[0] = False
        _helper.stop_all()  # after the drain: every copy handed to a helper has been delivered
        # Offloading stays refused (_d2h._CLOSING) until the next install_shim(): a thread still inside a wrapper
        # now runs torch's own copy, which torch's own synchronizes cover.
    if pending_error is not None:
        raise pending_error


def is_shim_installed() -> bool:
    return _STATE.installed

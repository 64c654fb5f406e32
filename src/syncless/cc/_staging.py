"""H2D on a per-device idle staging stream, and registered in-place targets.

Under CC a host->device copy returns only when its stream has drained. Issued
on the busy current stream it would wait for all queued work; issued on an
idle staging stream it waits for the transfer alone::

    current : [ K1 ......... K2 ......... ] [wait E] consumer
    staging :  copy H->D  E                             (host returns after the copy only)

Every path below keeps the original stream semantics: the consumer on the
current stream sees the data, and nothing the current stream queued earlier
sees it early.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from syncless._core import patching
from syncless._core.layouts import broadcasts_to, same_dense_layout
from syncless.cc import _emulation, _host_writes, _streams

# Registered targets: (device index, storage address) -> {(first byte, end byte): a weak reference to the target}.
# Several tensors over one storage (the rows of one pool tensor) are registered apart, and a lookup asks only the
# targets on its own storage (the exact span first: a copy into the registered row itself). A dead reference
# vouches for nothing; dead ones are dropped at the next registration. The dictionaries change only under
# ``_target_lock`` (no weakref callback changes them: one ran during a lookup's snapshot, found in review), and a
# lookup that scans reads a copy made under it.
_TARGETS: dict[tuple[int | None, int], dict[tuple[int, int], Any]] = {}
_target_lock = threading.Lock()


def _storage_key(t: Any) -> tuple[int | None, int]:
    return (t.device.index, t.untyped_storage().data_ptr())


def _span(t: Any) -> tuple[int, int]:
    """The bytes ``t``'s elements lie within: its first element's address to one past its last (empty without any)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _remember_target(t: Any) -> bool:
    """Record ``t`` as a registered target (plain bookkeeping); return whether it is new."""
    storage, span = _storage_key(t), _span(t)
    with _target_lock:
        for key, spans in list(_TARGETS.items()):  # drop the targets that have died
            for dead in [entry for entry, ref in spans.items() if ref() is None]:
                del spans[dead]
            if not spans:
                del _TARGETS[key]
        spans = _TARGETS.setdefault(storage, {})
        ref = spans.get(span)
        if ref is not None and ref() is t:
            return False
        spans[span] = weakref.ref(t)
        return True


def live_targets() -> int:
    """How many registered targets are alive (tests: entries lapse with their tensors)."""
    with _target_lock:
        return sum(1 for spans in _TARGETS.values() for ref in spans.values() if ref() is not None)


def register_inplace_h2d_target(t: Any) -> None:
    """Let ``non_blocking`` H2D copies into ``t`` (or its views) land directly on the staging stream.

    The caller promises that no GPU reader of ``t`` is in flight when it is
    rewritten (e.g. a round-robin pool of input buffers). A copy lands in
    place if its destination lies within ``t``'s bytes (its first element to
    its last): a view of ``t``, not another tensor on the same storage
    outside them (a sibling row of one pool tensor). The registration
    lapses when ``t`` is garbage collected, so a later tensor at the same
    address is not matched. The first registration of ``t`` makes the
    staging stream wait (GPU-side) for the work queued so far on the current
    stream, so whatever initialized ``t`` finishes before the first upload.
    Does not block the host.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: ``t`` is not a strided CUDA tensor, or is a ZeroTensor.
    """
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"register_inplace_h2d_target expects a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" or t.layout != torch.strided:
        raise ValueError(f"register_inplace_h2d_target expects a strided CUDA tensor, got device={t.device}, "
                         f"layout={t.layout}")
    if t._is_zerotensor():
        raise ValueError("register_inplace_h2d_target expects a tensor with memory of its own, got a ZeroTensor "
                         "(immutable: nothing can be uploaded into it)")
    if _remember_target(t):
        index = t.device.index
        # staging : [wait E] uploads into t ...
        # current : zero-fill t  E
        _streams.order_after(_streams.staging_stream(index), _streams.current_stream(index))


def is_registered_target(t: Any) -> bool:
    """Return whether ``t`` lies within a live registered in-place target: on its storage, within its bytes.

    Within the bytes, not merely on the storage: registering one row of a pool tensor vouched for every row
    (found in review: an upload into a sibling row that a kernel was still reading landed in place, ahead of
    that kernel). The registered tensor must still own the storage it was registered with: one whose storage
    moved (``resize_`` growing it, ``set_``, ``.data =``) no longer vouches for its old address, which the
    caching allocator may hand to an unrelated tensor (found in review); its entry is dropped. A tensor without
    memory of its own (a ZeroTensor: torch raises at the read of its storage's address) shares none: False.
    A dictionary lookup while no target shares ``t``'s storage; one more for the exact span (the target itself,
    or a view of all of it); otherwise a copy of that storage's targets, made under the lock, and a look at each.
    """
    if not _TARGETS:
        return False
    try:
        storage = _storage_key(t)
    except RuntimeError:
        return False  # no storage address to share (the copy then goes on as torch's, which raises its own error)
    spans = _TARGETS.get(storage)
    if not spans:
        return False
    span = _span(t)
    ref = spans.get(span)
    if ref is not None and _vouches(ref, storage, span):
        return True
    with _target_lock:
        items = list(spans.items())  # a copy: other threads may register meanwhile
    for (first, end), ref in items:
        if first <= span[0] and span[1] <= end and _vouches(ref, storage, span):
            return True
    return False


def _vouches(ref: Any, storage: tuple, span: tuple[int, int]) -> bool:
    """Whether the target ``ref`` names is alive, still owns ``storage``, and spans ``span`` as it is now; a target
    whose storage moved is dropped. (A target resized or moved within its storage after registration vouches for
    the bytes it spans both then and now: register it again to cover more.)"""
    target = ref()
    if target is None:
        return False
    if _storage_key(target) != storage:
        with _target_lock:
            spans = _TARGETS.get(storage)
            if spans is not None:
                for key in [key for key, entry in spans.items() if entry is ref]:
                    del spans[key]
        return False
    first, end = _span(target)
    return first <= span[0] and span[1] <= end


def _torch_own(name: str):
    """torch's own ``Tensor.<name>``, beneath every syncless layer (the CC emulator's too).

    The shim's own copies call it directly: a device-to-device copy or a
    ``meta`` layout query has nothing to emulate, and after a host<->device
    copy the shim asks for the emulated wait itself
    (:func:`._emulation.wait_after_copy_on`), for the stream it used, instead
    of having the emulation layer read the call again.
    """
    import torch

    own = _TORCH_OWN.get(name)
    if own is None:
        own = _TORCH_OWN[name] = patching.original(torch.Tensor, name)
    return own


_TORCH_OWN: dict[str, Any] = {}  # torch's own Tensor methods by name (what patching.original gives; never changes)


def land(src: Any, index: int, how: str = "to", current: Any = None) -> Any:
    """Copy host ``src`` to a new tensor on GPU ``index``, on the staging stream; hand it to the current stream.

    Enqueues the copy on the staging stream and a wait for it on the current
    stream; the host waits at most for the transfer itself (under CC, and
    when CC is emulated). ``how`` is the tensor method that makes the copy,
    ``"to"`` or ``"cuda"`` (the one the caller called, so its result is
    torch's own); ``current``: the current stream of GPU ``index``, where the
    caller has it already. The result is allocated on the staging stream (so the allocator cannot
    hand out memory the current stream may still be using) and then marked
    as used by the current stream (``record_stream``), so its memory is not
    recycled before the current stream is done with it.

    Ordering: the staging copy needs nothing from the current stream (the
    destination is new), only the D2H copies still writing the host source
    (:mod:`._host_writes`); the current stream's later work waits for the copy.
    """
    if how not in ("to", "cuda"):
        raise ValueError(f"land copies with Tensor.to or Tensor.cuda, got how={how!r}")
    if current is None:
        current = _streams.current_stream(index)
    staging = _streams._staging.get(index) or _streams.staging_stream(index)
    _host_writes.order_after_pending_writes(staging, src)
    with _streams.OnStream(staging, current):
        if how == "cuda":
            landed = _torch_own("cuda")(src, index, non_blocking=True)
        else:
            landed = _torch_own("to")(src, device=landed_on(index), non_blocking=True)
    _emulation.wait_after_copy_on(staging)
    _streams.order_after(current, staging)
    landed.record_stream(current)
    return landed


_DEVICES: dict[int, Any] = {}


def landed_on(index: int) -> Any:
    """``torch.device("cuda", index)``, made once per GPU."""
    device = _DEVICES.get(index)
    if device is None:
        import torch

        device = _DEVICES[index] = torch.device("cuda", index)
    return device


def land_converted(src: Any, index: int, dtype: Any, memory_format: Any) -> Any:
    """``src.to(cuda:index, dtype, memory_format=..., non_blocking=True)`` for host ``src``, through the staging stream.

    staging : copy host -> tmp  E
    current : [wait E] result <- tmp (the cast or the new layout, a D2D)

    With no conversion this is :func:`land`. Otherwise the result has the
    layout torch's own ``.to`` would give it (read from the same call on the
    meta device), and the host source is read when torch would read it, as in
    :func:`stage_into`: a block torch moves as it lies (the source's dtype and
    dense layout, or a contiguous source) is staged in stream order; any other
    source torch makes contiguous on the host at the call, and so does this.
    Does not block the host beyond the transfer (under CC).
    """
    import torch

    fmt = torch.preserve_format if memory_format is None else memory_format
    target_dtype = src.dtype if dtype is None else dtype
    if target_dtype == src.dtype and fmt is torch.preserve_format:
        return land(src, index)
    shape = _torch_own("to")(src, device="meta", dtype=target_dtype, memory_format=fmt)  # torch's layout for the result
    if src.is_contiguous() or (target_dtype == src.dtype and same_dense_layout(shape.shape, shape.stride(),
                                                                               src.shape, src.stride())):
        landed = land(src, index)  # torch moves this block as it lies, in stream order
    else:
        landed = land(_read_now(src, index), index)  # torch reads it now
    result = torch.empty_strided(shape.shape, shape.stride(), dtype=target_dtype, device=landed.device)
    _torch_own("copy_")(result, landed)  # on the current stream, which waits for the staging copy (land)
    return result


def stage_into(dst: Any, src: Any, next_copy) -> Any:
    """``dst.copy_(src, non_blocking=True)`` for CUDA ``dst`` and host ``src`` through a staging tensor.

    staging : copy host -> tmp  E
    current : ... readers of dst ... [wait E] dst <- tmp (D2D, and the cast if dtypes differ)

    The D2D runs on the current stream, so it is ordered exactly where the
    original copy would have been: a kernel still reading ``dst`` is not
    overwritten. A dtype conversion happens in that D2D, never on the staging
    stream. Does not block the host beyond the transfer (under CC).

    The host source is read when torch would read it (:func:`_torch_reads_source_now`):

    - torch copies one block of memory as it lies (equal dtypes and one dense
      layout, e.g. two transposes) or a contiguous source in its stream's
      order; the staging transfer reads the same block, after the D2H copies
      still writing it (:mod:`._host_writes`);
    - otherwise torch makes a contiguous host temporary of the (broadcast)
      source when the call is made, and a program may overwrite the source
      right after; so does the shim. (The fuzzer found both on an H200: a
      transposed pinned source staged as it was was read after a D2H issued
      next had overwritten it; made contiguous at the call, a transposed
      source whose transpose torch moves as it lies was read before the D2H
      queued ahead of it had written it.)
    """
    if not broadcasts_to(tuple(src.shape), tuple(dst.shape)) or _overlaps_itself(dst):
        return next_copy(dst, src, non_blocking=True)  # torch raises its own error, before copying anything
    index = dst.device.index
    if _torch_reads_source_now(dst, src):
        # torch reads the (broadcast) source into a host temporary now; a snapshot of the source's own
        # elements holds the same values and keeps the staged bytes (and max_staged_bytes) at its size:
        # the D2D below broadcasts.
        tmp = land(_read_now(src, index), index)
    elif src.is_contiguous():
        tmp = land(src, index)
    else:  # one dense block: move it as it lies, then view it with the source's strides
        block = src.as_strided((src.numel(),), (1,), src.storage_offset())
        tmp = land(block, index).as_strided(tuple(src.shape), tuple(src.stride()), 0)
    _torch_own("copy_")(dst, tmp, non_blocking=True)  # a D2D on the current stream: nothing to emulate
    return dst


def _read_now(src: Any, index: int) -> Any:
    """A contiguous host copy of ``src``'s elements, read now, as torch's own copy reads them at the call (through
    a host temporary), after the offloaded D2H copies still writing them: the host waits for those, and a failure
    among them is raised (:func:`._host_writes.wait_for_offloaded_writes`; found in review: the copy was read
    first, so the staged bytes were stale, and a failed copy's unwritten buffer was uploaded without an error).

    A plain D2H still writing ``src`` (torch's own, on some stream) is not waited for: torch's copy reads ``src``
    at the call too, so a program correct under torch has waited for it already (and under CC it finished at its
    call).
    """
    import torch

    if _host_writes.NOTED_STARTS:
        _host_writes.wait_for_offloaded_writes(src)
    return src.clone(memory_format=torch.contiguous_format)


def _overlaps_itself(dst: Any) -> bool:
    """Whether torch refuses ``dst`` as a copy target: a dim of size > 1 with stride 0 (an expanded tensor).

    That is the overlap torch itself detects before it reads anything (other overlaps it leaves alone).
    """
    return any(size > 1 and stride == 0 for size, stride in zip(dst.shape, dst.stride()))


def _torch_reads_source_now(dst: Any, src: Any) -> bool:
    """Whether torch's ``dst.copy_(src, non_blocking=True)`` (H2D) reads host ``src`` at the call.

    With equal dtypes and one dense layout torch moves the block directly, in
    stream order. Otherwise it copies through a temporary: the source, broadcast
    to ``dst``'s shape, is made contiguous on the host first (a new tensor, read
    now, unless it already was contiguous); the cast, if any, happens on the GPU.
    """
    # What torch's iterator sees (extra leading dims of size 1 too); the common equal-shape case makes no view.
    expanded = src if src.shape == dst.shape else src.expand_as(dst)
    if dst.dtype == src.dtype and same_dense_layout(dst.shape, dst.stride(), expanded.shape, expanded.stride()):
        return False
    return not expanded.is_contiguous()


def copy_in_place(dst: Any, src: Any) -> Any:
    """Copy host ``src`` straight into registered target ``dst`` on the staging stream.

    staging : copy host -> dst  E
    current : [wait E] readers of dst

    The caller promised no reader of ``dst`` is in flight; the staging stream
    is ordered after the target's initialization at registration. ``dst`` is
    marked as used by the staging stream so its memory is not recycled before
    the copy has run. Does not block the host beyond the transfer (under CC).
    """
    index = dst.device.index
    current = _streams.current_stream(index)
    staging = _streams.staging_stream(index)
    _host_writes.order_after_pending_writes(staging, src)
    with _streams.OnStream(staging, current):
        _torch_own("copy_")(dst, src, non_blocking=True)
    _emulation.wait_after_copy_on(staging)
    dst.record_stream(staging)
    _streams.order_after(current, staging)
    return dst

"""Implicit syncs: ``non_blocking`` copies between CPU and GPU that block anyway.

torch's debug mode never sees these: torch issues ``cudaMemcpyAsync``, but
the driver runs a copy from or to *pageable* memory synchronously, and a CPU
tensor that is not densely laid out is first staged through a fresh pageable
temporary. :func:`classify_copy` is the one place that decides, from the two
tensors' facts, following what torch's CUDA copy does (``copy_kernel_cuda``
and ``copy_requires_temporaries``):

* H2D: the source must be pinned; a pinned source is used in place when
  it is contiguous (after broadcasting to the destination), or when it is
  laid out exactly like the destination with the same dtype (so a transposed
  ``.to(device)`` is fine: the result keeps the source's strides);
  otherwise torch makes it contiguous in pageable memory first.
* D2H: the destination must be pinned, and contiguous unless it is laid out
  exactly like the source with the same dtype; otherwise torch copies into a
  pageable temporary. ``.to("cpu", non_blocking=True)`` allocates a pinned
  result, so it is fine.
* Empty copies move nothing and are fine.

The wrappers of ``Tensor.to``, ``Tensor.cuda`` and ``Tensor.copy_`` are
installed through :mod:`syncless._core.patching` (layer key ``"syncs"``, the
top rank), so they see the user's call and never syncless's internal copies.
They take and pass on the caller's arguments untouched, so torch parses every
call itself (the contract is in ``docs/syncs.md``, "Calling conventions"). Outside a
checked region the wrapper is not called at all: the patch entry reads the
region depth (``idle``, one ContextVar read) and calls the method beneath
directly, one Python call in all.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from syncless._core import patching
from syncless._core.layouts import broadcasts_to, is_dense_layout
from syncless._core.tensor_calls import (
    dispatch_modes,
    functorch_active,
    has_override,
    maybe_non_blocking_to,
    parse_to,
    read_copy,
    read_cuda,
    reads_as_cuda_device,
)
from syncless.syncs import _report
from syncless.syncs._state import checked_depth, is_violation_context

LAYER_KEY = "syncs"

PAGEABLE_H2D = "pageable_h2d"
STRIDED_H2D = "strided_h2d"
PAGEABLE_D2H = "pageable_d2h"
STRIDED_D2H = "strided_d2h"

REASONS = {
    PAGEABLE_H2D: "from pageable (not pinned) CPU memory, which the driver copies synchronously",
    STRIDED_H2D: "from a pinned CPU tensor that is not dense: torch first copies it into a pageable temporary, "
    "so the copy runs synchronously",
    PAGEABLE_D2H: "into pageable (not pinned) CPU memory: the host waits for the GPU work before it and the copy",
    STRIDED_D2H: "into a pinned CPU tensor that is not dense: torch copies through a pageable temporary and "
    "the host waits",
}
FIXES = {
    PAGEABLE_H2D: "allocate the CPU tensor with pin_memory=True (or fill a reusable pinned staging buffer) so "
    "the copy runs asynchronously",
    STRIDED_H2D: "make the pinned source dense first (gather into a contiguous pinned buffer on the CPU, or "
    "upload the whole dense tensor and slice on the GPU)",
    PAGEABLE_D2H: "copy into a pinned destination (torch.empty(..., pin_memory=True)) or use "
    "tensor.to('cpu', non_blocking=True), which returns pinned memory; wait on an event before reading it",
    STRIDED_D2H: "copy into a dense pinned destination and take the slice on the CPU after the event",
}


@dataclass(frozen=True)
class TensorFacts:
    """What the classification needs to know about one side of a copy.

    Real tensors have the same attributes and methods, so
    :func:`classify_copy` takes either; tests describe pinned CPU tensors
    with this on a machine without CUDA.
    """

    is_cuda: bool
    is_cpu: bool
    pinned: bool
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: Any

    def is_pinned(self) -> bool:
        return self.pinned

    def is_contiguous(self) -> bool:
        return is_contiguous_layout(self.shape, self.strides)

    def numel(self) -> int:
        return math.prod(self.shape)

    def stride(self) -> tuple[int, ...]:
        return self.strides


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def is_contiguous_layout(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's ``is_contiguous``: row-major, ignoring dims of size 1 (and empty tensors)."""
    if any(size == 0 for size in shape):
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _broadcast_strides(src_shape: Sequence[int], src_strides: Sequence[int], dst_shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of ``src.expand_as(dst)``: 0 along broadcast dims."""
    offset = len(dst_shape) - len(src_shape)
    out = []
    for index, size in enumerate(dst_shape):
        src_index = index - offset
        if src_index < 0 or (src_shape[src_index] == 1 and size != 1):
            out.append(0)
        else:
            out.append(src_strides[src_index])
    return tuple(out)


def _same_dense_layout(shape: Sequence[int], dst_strides: Sequence[int], src_strides: Sequence[int]) -> bool:
    """Whether torch's copy iterator sees both sides as one contiguous run."""
    if not is_dense_layout(shape, dst_strides):
        return False
    return all(size == 1 or a == b for size, a, b in zip(shape, dst_strides, src_strides))


def classify_copy(dst: Any, src: Any, non_blocking: bool) -> str | None:
    """Return why copying ``src`` into ``dst`` blocks the host although ``non_blocking``.

    Args:
        dst, src: tensors, or :class:`TensorFacts` describing them (``dst``
            may be the result a ``.to()`` call is about to allocate).
        non_blocking: what the caller asked for. A blocking copy is torch's
            debug mode's business, not an implicit sync, so this returns None.

    Returns:
        One of :data:`PAGEABLE_H2D`, :data:`STRIDED_H2D`,
        :data:`PAGEABLE_D2H`, :data:`STRIDED_D2H`; None when the copy is
        asynchronous (or is not between the CPU and a GPU).
    """
    if not non_blocking:
        return None
    if src.is_cpu and dst.is_cuda:
        h2d = True
    elif src.is_cuda and dst.is_cpu:
        h2d = False
    else:
        return None
    numel = dst.numel()
    if numel == 0:
        return None
    if h2d:
        if not src.is_pinned():
            return PAGEABLE_H2D
        if src.numel() == numel and src.is_contiguous():
            return None  # used in place whatever the destination looks like
        src_strides = _broadcast_strides(tuple(src.shape), tuple(src.stride()), tuple(dst.shape))
        if numel == 1 or (src.dtype == dst.dtype and _same_dense_layout(tuple(dst.shape), tuple(dst.stride()), src_strides)):
            return None
        if is_contiguous_layout(tuple(dst.shape), src_strides):
            return None
        return STRIDED_H2D
    if not dst.is_pinned():
        return PAGEABLE_D2H
    if dst.is_contiguous():
        return None
    src_strides = _broadcast_strides(tuple(src.shape), tuple(src.stride()), tuple(dst.shape))
    if src.dtype == dst.dtype and _same_dense_layout(tuple(dst.shape), tuple(dst.stride()), src_strides):
        return None
    return STRIDED_D2H


def planned_to_result(src: Any, to_cuda: bool, dtype: Any, memory_format: Any, non_blocking: bool) -> TensorFacts:
    """Describe the tensor ``src.to(...)`` allocates for a copy across the CPU/GPU line.

    torch allocates it like ``empty_like(src)`` with ``preserve_format`` (a
    dense source keeps its strides, any other becomes contiguous) unless a
    memory format is given, and pins a CPU result of a ``non_blocking`` D2H.
    """
    import torch

    shape = tuple(src.shape)
    if memory_format is None or memory_format is torch.preserve_format:
        stride = tuple(src.stride())
        strides = stride if is_dense_layout(shape, stride) else contiguous_strides(shape)
    else:
        strides = tuple(torch.empty(shape, device="meta", memory_format=memory_format).stride())
    return TensorFacts(
        is_cuda=to_cuda,
        is_cpu=not to_cuda,
        pinned=(not to_cuda) and bool(non_blocking),
        shape=shape,
        strides=strides,
        dtype=src.dtype if dtype is None else dtype,
    )


def _plain_tensor_types() -> tuple[type, ...]:
    import torch

    return (torch.Tensor, torch.nn.Parameter)


def _stepping_aside(*tensors: Any) -> bool:
    """Whether the checks must stay out, and pass the call on unread.

    They stay out of what they would change by reading a tensor (each read,
    ``is_pinned()`` included, is a torch op): torch.compile tracing (fake or
    functional tensors), a ``TorchDispatchMode`` (it would see those ops), a
    functorch transform (``vmap``/``grad`` wrappers have no batching rule for
    ``is_pinned``), and tensors whose layout is not strided (nested tensors
    have no sizes, sparse ones no strides).
    """
    import torch

    plain = _plain_tensor_types()
    if any(type(t) not in plain for t in tensors):
        return True
    if torch.compiler.is_compiling() or dispatch_modes():
        return True
    real = tuple(t for t in tensors if isinstance(t, torch.Tensor))  # not the TensorFacts tests stand in with
    if functorch_active(real):
        return True
    return any(t.is_nested or t.layout is not torch.strided for t in real)


def _report_copy(reason: str, api: str) -> None:
    if not is_violation_context():
        return
    operation = f"{api} with non_blocking=True {REASONS[reason]}"
    violation = _report.locate(_report.KIND_IMPLICIT, operation, FIXES[reason], sys._getframe(1))
    if violation is not None:
        _report.handle(violation)


def _planned(src: Any, to_cuda: bool, dtype: Any, memory_format: Any, non_blocking: bool) -> TensorFacts | None:
    """:func:`planned_to_result`, or None for a memory format torch refuses for this tensor (it raises then)."""
    try:
        return planned_to_result(src, to_cuda, dtype, memory_format, non_blocking)
    except RuntimeError:  # e.g. channels_last for a tensor that is not 4-d
        return None


def _read_to(self: Any, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """Return (reason, api) if ``self.to(*args, **kwargs)`` would block although non_blocking, else None.

    ``args`` excludes the tensor.

    Reads the call with torch's own parser; a call the parser refuses is left
    alone, so torch raises its own error for it.
    """
    if not maybe_non_blocking_to(args, kwargs) or _stepping_aside(self):
        return None
    device, dtype, non_blocking, memory_format = parse_to(args, kwargs)
    if non_blocking is not True or device is None:
        return None
    if self.is_cpu and device.type == "cuda":
        to_cuda = True
    elif self.is_cuda and device.type == "cpu":
        to_cuda = False
    else:
        return None
    result = _planned(self, to_cuda, dtype, memory_format, non_blocking)
    reason = None if result is None else classify_copy(result, self, non_blocking)
    return None if reason is None else (reason, f"Tensor.to({device.type})")


def _read_cuda(self: Any, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """Return (reason, api) if ``self.cuda(*args, **kwargs)`` would block although non_blocking, else None.

    ``args`` excludes the tensor.

    Only torch's own form is read (:func:`read_cuda`); any other (the
    deprecated ``async=``, a repeated or unknown argument, a non-bool
    ``non_blocking``) is left alone, so torch accepts or refuses it itself.
    """
    import torch

    call = read_cuda(args, kwargs)
    if call is None:
        return None
    device, non_blocking, memory_format = call
    if non_blocking is not True or _stepping_aside(self) or not self.is_cpu:
        return None
    if not reads_as_cuda_device(device):
        return None
    if memory_format is not None and not isinstance(memory_format, torch.memory_format):
        return None
    result = _planned(self, True, None, memory_format, non_blocking)
    reason = None if result is None else classify_copy(result, self, non_blocking)
    return None if reason is None else (reason, "Tensor.cuda()")


def _read_copy(self: Any, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """Return (reason, api) if ``self.copy_(*args, **kwargs)`` would block although non_blocking, else None.

    ``args`` excludes the destination.

    Only torch's own form is read (:func:`read_copy`); any other (the
    deprecated ``async=``, a repeated or unknown argument, a non-bool
    ``non_blocking``) and a source that does not broadcast to the
    destination are left alone, so torch accepts or refuses them itself.
    """
    call = read_copy(args, kwargs)
    if call is None:
        return None
    src, non_blocking = call
    if non_blocking is not True or src is None or _stepping_aside(self, src):
        return None
    if not broadcasts_to(tuple(src.shape), tuple(self.shape)):
        return None  # torch refuses the copy itself
    reason = classify_copy(self, src, non_blocking)
    return None if reason is None else (reason, f"Tensor.copy_ ({'H2D' if self.is_cuda else 'D2H'})")


def _checking(read):
    """Make the check that reports what ``read`` finds; a call it cannot read is passed on unchecked.

    Reading may fail where torch would not (a parser or a tensor attribute
    refusing an unusual tensor or form): torch then runs, or refuses, the
    call itself, as without the detector. Only the report may raise
    (``SyncViolation`` in error mode).
    """

    def check(self: Any, args: tuple, kwargs: dict) -> None:
        try:
            found = read(self, args, kwargs)
        except (RuntimeError, TypeError, ValueError):
            return
        if found is not None:
            _report_copy(*found)

    return check


_check_to = _checking(_read_to)
_check_cuda = _checking(_read_cuda)
_check_copy = _checking(_read_copy)


def _make_wrapper(check, beneath):
    # Takes and passes on exactly what the caller gave (*args, **kwargs, the tensor included), so torch
    # parses every call itself: its forms, defaults, errors and deprecation warnings stay its own. Outside a
    # checked region the patch entry skips it (see install); inside, ``check`` reads the call defensively and never
    # raises for a form it does not understand. A call torch hands to a ``__torch_function__`` override (a
    # subclass's or a mode's) is not read here, since reading it would call the override; the override's call
    # back into torch, made with overrides disabled, is the one checked.
    # The wrapper keeps the name of what it wraps ("to", "cuda", "copy_"): dynamo then treats the bound
    # method as a plain tensor method and puts the call in the graph instead of tracing into this function,
    # so fullgraph=True holds.
    # Whether dynamo traces this wrapper, asked first: dynamo traces it for an unbound torch.Tensor.to(x, ...)
    # or a functools.partial of it, folds the question to True, and goes straight to the torch method beneath,
    # never reaching the ContextVar read (which it cannot trace: fullgraph=True would fail). Outside dynamo,
    # is_dynamo_compiling is a function returning False (is_compiling, where it is missing, costs more).
    import torch

    depth = checked_depth.get
    is_compiling = getattr(torch.compiler, "is_dynamo_compiling", None) or torch.compiler.is_compiling

    @functools.wraps(beneath)
    def wrapper(*args, **kwargs):
        if is_compiling():
            return beneath(*args, **kwargs)
        if args and depth() and not has_override(args, kwargs):
            check(args[0], args[1:], kwargs)
        return beneath(*args, **kwargs)

    return wrapper


_CHECKS = {"to": _check_to, "cuda": _check_cuda, "copy_": _check_copy}


def install() -> None:
    """Wrap ``Tensor.to``, ``Tensor.cuda`` and ``Tensor.copy_`` (idempotent)."""
    import torch

    for name, check in _CHECKS.items():
        patching.add_layer(torch.Tensor, name, LAYER_KEY, patching.RANK_SYNC_DETECTOR, functools.partial(_make_wrapper, check),
                           idle=checked_depth.get)


def uninstall() -> None:
    """Remove the wrappers; the attributes beneath come back by identity."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for name in _CHECKS:
        patching.remove_layer(torch.Tensor, name, LAYER_KEY)

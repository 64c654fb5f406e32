"""Persistent receive tensors in a device allocation of their own, for ``depth=0``.

With ``depth=0`` the previous stage copies straight into the receiver's
persistent tensors, so set-up shares them over legacy CUDA IPC. IPC shares
a whole allocation (what ``cuMemAlloc`` returned), never a byte range, and
the peer may then read and write all of it. Tensors from torch's caching
allocator sit in segments shared with other tensors: blocks under 1 MiB
in 2 MiB segments, mid-size ones in 20 MiB segments; even a large tensor
that got a segment of its own leaves the rounding at its end free for
another tensor, and a free cached segment is reused, split, for later
ones. Sharing such a segment would hand the neighbour stage unrelated
tensors (weights, the KV cache).

:func:`alloc_persistent` makes one ``cuMemAlloc`` allocation (always
shareable over legacy IPC, whatever ``PYTORCH_CUDA_ALLOC_CONF`` says) and
carves the named tensors out of it, nothing else. ``make_transport`` with
``depth=0`` accepts an allocation only if nothing but persistent tensors
can be in it (:func:`exposure_problem`), and otherwise refuses it with the
reason (``backend="auto"`` then falls back to torch.distributed, which
shares nothing).

The tensors reach torch as one DLPack capsule (a C struct built here with
``ctypes``) whose deleter frees the allocation when the last tensor (or
view) of it dies. Plain Python apart from the two driver calls, so the
carving and the freeing are unit-tested on the CPU over host memory.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from syncless._core import cuda
from syncless._core.errors import CudaError
from syncless.pp._layout import TensorSpec

logger = logging.getLogger(__name__)

#: Alignment of each tensor in the allocation (the copy engines' best case; any dtype's too).
ALIGN = 256
#: The device allocation is rounded up to whole 2 MiB pages: the driver may place small allocations
#: side by side in one page, and the GPU maps memory by the page (torch's caching allocator rounds alike).
ALLOCATION_GRANULE = 2 << 20

_DL_CPU, _DL_CUDA = 1, 2  # DLDeviceType
_DL_UINT = 1  # DLDataTypeCode


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_CAPSULE_NAME = b"dltensor"  # module-level: the capsule keeps a pointer to these bytes
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Span(NamedTuple):
    """Bytes ``[start, end)`` of one named tensor (absolute addresses)."""

    name: str
    start: int
    end: int


class _Owned:
    """One allocation made here: its address, size, carved tensors, and how to free it."""

    def __init__(self, base: int, nbytes: int, free: Callable[[], None]):
        self.base = base
        self.nbytes = nbytes
        self.free = free
        self.spans: list[Span] = []
        self.keep: list[Any] = []  # the ctypes structs torch points to, alive until the deleter ran


_owned: dict[int, _Owned] = {}  # base address -> allocation; entries leave in the deleter
_owned_lock = threading.Lock()


def carved_spans(base: int) -> list[Span] | None:
    """Return the tensors :func:`alloc_persistent` carved from the live allocation at ``base`` (None: not ours)."""
    with _owned_lock:
        owned = _owned.get(base)
        return list(owned.spans) if owned is not None else None


def live_allocations() -> int:
    """Return how many allocations of :func:`alloc_persistent` are still alive (for tests)."""
    with _owned_lock:
        return len(_owned)


@_Deleter
def _delete(managed: Any) -> None:
    # Called by torch (with the GIL taken by ctypes) when the last tensor of the allocation dies.
    if sys.is_finalizing():
        return  # the interpreter is going away; so is the process, and the driver frees its memory then
    base = int(managed.contents.manager_ctx or 0)
    with _owned_lock:
        owned = _owned.pop(base, None)
    if owned is None:
        return
    try:
        owned.free()
    except CudaError as err:  # nothing can be raised from here: say it instead of losing it
        if err.name != "CUDA_ERROR_DEINITIALIZED":  # the driver shut down first (process exit): nothing leaks
            logger.error("syncless.pp: freeing a persistent allocation of %d bytes failed: %s", owned.nbytes, err)


# Carving ---------------------------------------------------------------------------


def _shape_and_dtype(name: str, spec: Any) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(spec, TensorSpec):
        return (spec.max_rows, *spec.row_shape), spec.dtype
    if (
        isinstance(spec, Sequence) and len(spec) == 2 and isinstance(spec[1], torch.dtype)
        and isinstance(spec[0], Sequence) and all(isinstance(d, int) and not isinstance(d, bool) for d in spec[0])
    ):
        shape = tuple(int(d) for d in spec[0])
        if len(shape) < 1 or any(d < 0 for d in shape):
            raise ValueError(f"specs[{name!r}]: the shape needs a leading rows dimension and no negative extent; "
                             f"got {shape}")  # fmt: skip
        return shape, spec[1]
    raise TypeError(
        f"specs[{name!r}] must be a TensorSpec or a (shape, dtype) pair such as ((256, 8192), torch.bfloat16); "
        f"got {spec!r}"
    )


def plan(specs: Mapping[str, Any]) -> tuple[dict[str, tuple[int, tuple[int, ...], torch.dtype]], int]:
    """Return name -> ``(byte offset, shape, dtype)`` and the allocation's size; each tensor ALIGN-aligned.

    Raises:
        TypeError, ValueError: a name or spec is not usable (the message names it).
    """
    if not isinstance(specs, Mapping) or not specs:
        raise TypeError(f"specs must be a non-empty dict of name -> TensorSpec or (shape, dtype); got {specs!r:.80}")
    offsets: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    offset = 0
    for name, spec in specs.items():
        if not isinstance(name, str):
            raise TypeError(f"specs keys must be str; got {name!r}")
        shape, dtype = _shape_and_dtype(name, spec)
        nbytes = dtype.itemsize
        for extent in shape:
            nbytes *= extent
        offsets[name] = (offset, shape, dtype)
        offset += -(-nbytes // ALIGN) * ALIGN
    return offsets, max(offset, ALIGN)


def carve(
    specs: Mapping[str, Any],
    allocate: Callable[[int], tuple[int, Callable[[], None]]],
    dl_device: tuple[int, int],
) -> dict[str, torch.Tensor]:
    """Allocate with ``allocate(nbytes) -> (address, free)`` and carve ``specs`` out of it.

    ``dl_device`` is the DLPack ``(device type, id)`` of the memory. ``free``
    runs once, when the last tensor of the allocation (or a view of one) dies.
    """
    layout, nbytes = plan(specs)
    base, free = allocate(nbytes)
    owned = _Owned(base, nbytes, free)
    shape = (ctypes.c_int64 * 1)(nbytes)
    strides = (ctypes.c_int64 * 1)(1)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = base
    managed.dl_tensor.device = _DLDevice(*dl_device)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_DL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = strides
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = base
    managed.deleter = _delete
    owned.keep = [managed, shape, strides]
    with _owned_lock:
        _owned[base] = owned
    try:
        whole = torch.from_dlpack(_capsule_new(ctypes.addressof(managed), _CAPSULE_NAME, None))
    except BaseException:
        with _owned_lock:
            _owned.pop(base, None)
        free()  # torch did not take the capsule: its deleter will never run
        raise
    # From here the allocation belongs to `whole` and its views: torch calls _delete when the last one dies.
    tensors = {}
    for name, (offset, tensor_shape, dtype) in layout.items():
        count = dtype.itemsize
        for extent in tensor_shape:
            count *= extent
        tensors[name] = whole[offset: offset + count].view(dtype).view(tensor_shape)
        owned.spans.append(Span(name, base + offset, base + offset + count))
    return tensors


def alloc_persistent(specs: Mapping[str, Any], device: Any = None) -> dict[str, torch.Tensor]:
    """Allocate persistent receive tensors in one CUDA allocation that holds nothing else.

    Use them as ``make_transport``'s ``persistent`` with ``depth=0``: the
    previous stage then maps this allocation and no other memory of this
    process. Pass all of them (the allocation is shared whole).

    Args:
        specs: name -> :class:`TensorSpec` or ``(shape, dtype)``; the leading
            dimension is the most rows a step may carry. Order is kept.
        device: a CUDA device (default: the current one).

    Returns:
        name -> an uninitialized contiguous tensor (like ``torch.empty``),
        each aligned to 256 bytes, in one allocation rounded up to whole
        2 MiB pages (no other allocation shares a page with it). The allocation is freed when the last of
        them (or of their views) dies; the free blocks the host until the GPU
        is idle (like ``cudaFree``; torch's caching allocator does not hold
        this memory, so ``torch.cuda.memory_allocated`` does not count it).
        Enqueues nothing.

    Raises:
        TypeError, ValueError: a spec or the device is not usable.
        CudaError: the allocation failed (out of memory, for one).
        MissingDependencyError: cuda-bindings or the driver is missing.
    """
    chosen = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if chosen.type != "cuda":
        raise ValueError(f"alloc_persistent allocates GPU memory for depth=0; got device {chosen}")
    ordinal = chosen.index if chosen.index is not None else torch.cuda.current_device()
    plan(specs)  # bad specs fail before any CUDA call
    return carve(specs, lambda nbytes: _cuda_allocate(ordinal, whole_pages(nbytes)), (_DL_CUDA, ordinal))


def whole_pages(nbytes: int) -> int:
    """Round ``nbytes`` up to whole :data:`ALLOCATION_GRANULE` pages."""
    return -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE


def _cuda_allocate(ordinal: int, nbytes: int) -> tuple[int, Callable[[], None]]:
    """``cuMemAlloc`` in the primary context of GPU ``ordinal`` (retained until the free)."""
    dev = cuda.call("cuDeviceGet", ordinal)
    ctx = cuda.call("cuDevicePrimaryCtxRetain", dev)
    try:
        cuda.call("cuCtxPushCurrent", ctx)
        try:
            ptr = int(cuda.call("cuMemAlloc", nbytes))
        finally:
            cuda.call("cuCtxPopCurrent")
    except BaseException:
        cuda.call("cuDevicePrimaryCtxRelease", dev)
        raise

    def free() -> None:
        try:
            cuda.call("cuCtxPushCurrent", ctx)
            try:
                # Work still queued on any stream may use the tensors (torch frees external memory at once):
                # wait for it, then free.
                cuda.call("cuCtxSynchronize")
                cuda.call("cuMemFree", ptr)
            finally:
                cuda.call("cuCtxPopCurrent")
        finally:
            cuda.call("cuDevicePrimaryCtxRelease", dev)

    return ptr, free


# What depth=0 may share ----------------------------------------------------------------


def exposure_problem(
    allocations: Mapping[int, tuple[int, Sequence[Span]]],
    carved: Callable[[int], list[Span] | None] | None = None,
    mode: str = "depth=0",
) -> str | None:
    """Return why sharing these allocations would expose memory beyond the persistent tensors, or None.

    Args:
        allocations: base address -> ``(size, spans of the persistent tensors in it)``, the size being
            what the driver reports for the allocation (``cuMemGetAddressRange``).
        carved: the tensors :func:`alloc_persistent` carved from an allocation (None: not made there);
            default :func:`carved_spans`.
        mode: what shares them, for the message (``depth=0`` or ``depth="auto"``).

    An allocation of :func:`alloc_persistent` is safe when every tensor carved
    from it is persistent here (the padding between them holds nothing). Any
    other allocation is safe only when the persistent tensors cover every
    byte of it (while they live, nothing else can be placed there).
    """
    carved = carved or carved_spans
    for base, (size, spans) in allocations.items():
        names = ", ".join(repr(span.name) for span in spans)
        owned = carved(base)
        if owned is not None:
            missing = [span.name for span in owned if _uncovered(span.start, span.end, spans)]
            if missing:
                return (
                    f"{mode} shares whole allocations, and the one holding persistent[{names}] "
                    f"(from alloc_persistent) also holds {', '.join(map(repr, missing))}, which are not persistent "
                    "tensors of this transport: the previous stage could read and write them. Pass every tensor "
                    "of one alloc_persistent call, or allocate the others separately"
                )
            continue
        uncovered = _uncovered(base, base + size, spans)
        if uncovered:
            return (
                f"{mode} lets the previous stage map the whole allocation holding persistent[{names}], "
                f"{size} bytes of which {uncovered} are not persistent tensors (torch's caching allocator shares "
                "its segments among tensors: weights, the KV cache) and would be readable and writable there. "
                "Allocate the persistent tensors with syncless.pp.alloc_persistent(...), or use depth >= 1"
            )
    return None


def _uncovered(start: int, end: int, spans: Sequence[Span]) -> int:
    """Return how many bytes of ``[start, end)`` no span covers."""
    covered, cursor = 0, start
    for span in sorted(spans, key=lambda s: s.start):
        lo, hi = max(span.start, cursor), min(span.end, end)
        if hi > lo:
            covered += hi - lo
            cursor = hi
    return (end - start) - covered

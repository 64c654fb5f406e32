"""Which CUDA driver/runtime calls block the host, from the CUDA documentation.

Plain data and plain functions, so that they are tested on the CPU. The
rules follow the "API synchronization behavior" section of the CUDA runtime
and driver API references (see ``docs/syncs.md``):

* explicit waits: stream, event, context and device synchronize;
* synchronous memcpy: every direction blocks the host except device to
  device; pageable host to device first synchronizes the stream;
* asynchronous memcpy blocks when it involves pageable host memory (device
  to pageable host returns only once the copy is done; pageable host to
  device is staged after a stream sync) or is host to host;
* synchronous memset blocks only when its target is pinned host or managed
  memory (into device memory it is asynchronous to the host);
* freeing device or pinned memory (``cudaFree``, ``cudaFreeHost``,
  ``cuMemFree``, ``cuMemFreeHost``, arrays) synchronizes the device;
  ``cudaFreeAsync``/``cuMemFreeAsync``, ``cuMemUnmap`` and ``cuMemRelease``
  do not, and neither does ``cudaMalloc``;
* tearing a context down waits for its work.

Each watched call has an :class:`ApiRule`; copies and memsets carry where
their pointers sit in the call's parameter struct (the layouts of
``generated_cuda_runtime_api_meta.h`` and ``generated_cuda_meta.h``, one
8-byte word per field on 64-bit Linux), so the CUPTI callback can ask the
driver what memory each pointer is.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncless.syncs import _report

WAIT = "wait"
COPY = "copy"
MEMSET = "memset"
FREE = "free"
TEARDOWN = "teardown"

DEVICE = "device"
PINNED = "pinned"
PAGEABLE = "pageable"
MANAGED = "managed"
UNKNOWN = "unknown"
HOST_TYPES = (PINNED, PAGEABLE)

# cudaMemcpyKind
KIND_H2H, KIND_H2D, KIND_D2H, KIND_D2D, KIND_DEFAULT = 0, 1, 2, 3, 4
FROM_SYMBOL = -1  # a pointer field that names a __device__ symbol: device memory


@dataclass(frozen=True)
class CopyLayout:
    """Where a copy's pointers sit in its parameter struct (word indexes).

    Attributes:
        dst, src: word index of the pointer, or :data:`FROM_SYMBOL` for a device symbol.
        kind: word index of the ``cudaMemcpyKind``, or None when ``direction`` fixes it.
        direction: ``"H2D"`` or ``"D2H"`` for the driver's typed copies; None to
            take it from ``kind`` or, failing that, from both pointers.
        is_async: an ``Async`` variant.
    """

    dst: int
    src: int
    kind: int | None
    direction: str | None
    is_async: bool


@dataclass(frozen=True)
class ApiRule:
    """One watched CUDA call: its category, and the layout when pointers decide."""

    category: str
    layout: CopyLayout | None = None
    reason: str = ""


_WAIT_REASONS = {
    "Stream": "waits until all work queued on the stream is done",
    "Event": "waits until the event's work is done",
    "Ctx": "waits until all work of the context is done",
    "Device": "waits until all work on the device is done",
    "Thread": "waits until all work on the device is done",
}


def _waits() -> dict[str, ApiRule]:
    names = {
        "cudaStreamSynchronize": "Stream", "cudaStreamSynchronize_ptsz": "Stream", "cuStreamSynchronize": "Stream",
        "cuStreamSynchronize_ptsz": "Stream", "cudaEventSynchronize": "Event", "cuEventSynchronize": "Event",
        "cudaDeviceSynchronize": "Device", "cudaThreadSynchronize": "Thread", "cuCtxSynchronize": "Ctx",
        "cuCtxSynchronize_v2": "Ctx",
    }
    return {name: ApiRule(WAIT, reason=_WAIT_REASONS[what]) for name, what in names.items()}


def _copies() -> dict[str, ApiRule]:
    rules: dict[str, ApiRule] = {}

    def add(names: tuple[str, ...], layout: CopyLayout) -> None:
        for name in names:
            rules[name] = ApiRule(COPY, layout)

    # runtime: cudaMemcpy(dst, src, count, kind[, stream])
    add(("cudaMemcpy", "cudaMemcpy_ptds"), CopyLayout(0, 1, 3, None, False))
    add(("cudaMemcpyAsync", "cudaMemcpyAsync_ptsz"), CopyLayout(0, 1, 3, None, True))
    # cudaMemcpy2D(dst, dpitch, src, spitch, width, height, kind[, stream])
    add(("cudaMemcpy2D", "cudaMemcpy2D_ptds"), CopyLayout(0, 2, 6, None, False))
    add(("cudaMemcpy2DAsync", "cudaMemcpy2DAsync_ptsz"), CopyLayout(0, 2, 6, None, True))
    # cudaMemcpyToSymbol(symbol, src, count, offset, kind[, stream]); FromSymbol(dst, symbol, ...)
    add(("cudaMemcpyToSymbol", "cudaMemcpyToSymbol_ptds"), CopyLayout(FROM_SYMBOL, 1, 4, None, False))
    add(("cudaMemcpyToSymbolAsync", "cudaMemcpyToSymbolAsync_ptsz"), CopyLayout(FROM_SYMBOL, 1, 4, None, True))
    add(("cudaMemcpyFromSymbol", "cudaMemcpyFromSymbol_ptds"), CopyLayout(0, FROM_SYMBOL, 4, None, False))
    add(("cudaMemcpyFromSymbolAsync", "cudaMemcpyFromSymbolAsync_ptsz"), CopyLayout(0, FROM_SYMBOL, 4, None, True))
    # driver: cuMemcpy(dst, src, bytes[, stream]) on unified addresses
    add(("cuMemcpy", "cuMemcpy_ptds"), CopyLayout(0, 1, None, None, False))
    add(("cuMemcpyAsync", "cuMemcpyAsync_ptsz"), CopyLayout(0, 1, None, None, True))
    # cuMemcpyHtoD(dstDevice, srcHost, bytes[, stream]); cuMemcpyDtoH(dstHost, srcDevice, bytes[, stream])
    add(("cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds"), CopyLayout(0, 1, None, "H2D", False))
    add(("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz"), CopyLayout(0, 1, None, "H2D", True))
    add(("cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2_ptds"), CopyLayout(0, 1, None, "D2H", False))
    add(("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz"), CopyLayout(0, 1, None, "D2H", True))
    return rules


def _memsets() -> dict[str, ApiRule]:
    # Only the synchronous ones can block; their first parameter is the target pointer
    # (cudaMemset3D's is a cudaPitchedPtr passed by value, whose first field is the pointer).
    names = ("cudaMemset", "cudaMemset_ptds", "cudaMemset2D", "cudaMemset2D_ptds", "cudaMemset3D",
             "cudaMemset3D_ptds", "cuMemsetD8_v2", "cuMemsetD16_v2", "cuMemsetD32_v2", "cuMemsetD2D8_v2",
             "cuMemsetD2D16_v2", "cuMemsetD2D32_v2", "cuMemsetD8_v2_ptds", "cuMemsetD16_v2_ptds",
             "cuMemsetD32_v2_ptds", "cuMemsetD2D8_v2_ptds", "cuMemsetD2D16_v2_ptds", "cuMemsetD2D32_v2_ptds")
    return {name: ApiRule(MEMSET) for name in names}


def _frees() -> dict[str, ApiRule]:
    reason = "synchronizes the device before it frees (implicitly)"
    names = ("cudaFree", "cudaFreeHost", "cudaFreeArray", "cudaFreeMipmappedArray", "cuMemFree_v2",
             "cuMemFreeHost", "cuArrayDestroy", "cuMipmappedArrayDestroy")
    return {name: ApiRule(FREE, reason=reason) for name in names}


def _teardowns() -> dict[str, ApiRule]:
    reason = "waits for all work of the context before tearing it down"
    names = ("cudaDeviceReset", "cuCtxDestroy_v2", "cuDevicePrimaryCtxReset_v2")
    return {name: ApiRule(TEARDOWN, reason=reason) for name in names}


RULES: dict[str, ApiRule] = {**_waits(), **_copies(), **_memsets(), **_frees(), **_teardowns()}

KINDS = {
    WAIT: _report.KIND_WAIT,
    COPY: _report.KIND_BLOCKING_COPY,
    MEMSET: _report.KIND_MEMSET,
    FREE: _report.KIND_ALLOCATOR,
    TEARDOWN: _report.KIND_TEARDOWN,
}

FIXES = {
    WAIT: _report.FIX_WAIT,
    COPY: "copy between device memory and pinned host memory with an Async copy on a stream and wait on an "
    "event later (for torch tensors: pin_memory() and non_blocking=True); never copy into or out of pageable memory "
    "in the hot loop; if the copy is intended, wrap it in `with syncless.syncs.allowed():`",
    MEMSET: "set device memory, or use the Async variant on a stream; host memory is better written by the host",
    FREE: "keep memory allocated across steps: no torch.cuda.empty_cache() and no freeing of device or pinned "
    "buffers in the hot loop (reuse them; cudaFreeAsync/cuMemFreeAsync are stream-ordered and do not block)",
    TEARDOWN: "create and destroy contexts outside the hot loop",
}


def base_name(cbid_name: str) -> str:
    """Strip CUPTI's API version suffix: ``cudaMemcpy_v3020`` -> ``cudaMemcpy``, ``..._ptsz_v7000`` -> ``..._ptsz``."""
    head, sep, tail = cbid_name.rpartition("_v")
    if sep and tail.isdigit() and len(tail) >= 4 and head.startswith("cuda"):
        return head
    return cbid_name


def copy_blocks(is_async: bool, src: str, dst: str) -> str | None:
    """Return why a copy from ``src`` to ``dst`` memory blocks the host, or None if it does not.

    Args:
        is_async: whether the call is an ``Async`` variant.
        src, dst: :data:`DEVICE`, :data:`PINNED`, :data:`PAGEABLE`,
            :data:`MANAGED` or :data:`UNKNOWN` (never reported).
    """
    if UNKNOWN in (src, dst):
        return None
    if not is_async and MANAGED in (src, dst):
        return "copies Unified Memory synchronously: fully synchronous with the host"
    src_host, dst_host = src in HOST_TYPES, dst in HOST_TYPES
    if src_host and dst_host:
        return "copies host to host: fully synchronous with the host"
    if not src_host and not dst_host:
        return None  # device to device: no host synchronization
    if src_host:
        if src == PAGEABLE:
            return "copies from pageable host memory: the driver synchronizes the stream to stage it"
        return None if is_async else "is a synchronous copy from pinned memory: it returns after the copy"
    if dst == PAGEABLE:
        return "copies into pageable host memory: it returns only once the copy has completed"
    return None if is_async else "copies device to host synchronously: it returns only once the copy has completed"


def kind_sides(kind: int) -> tuple[str | None, str | None]:
    """For a ``cudaMemcpyKind``: which side is device memory (DEVICE) and which must be looked up (None)."""
    if kind == KIND_H2D:
        return None, DEVICE
    if kind == KIND_D2H:
        return DEVICE, None
    if kind == KIND_D2D:
        return DEVICE, DEVICE
    if kind == KIND_H2H:
        return PAGEABLE, PAGEABLE  # host to host blocks whatever the host memory is
    return None, None


def memset_blocks(target: str) -> str | None:
    """Return why a synchronous memset into ``target`` memory blocks the host, or None."""
    if target == PINNED:
        return "sets pinned host memory: fully synchronous with the host"
    if target == MANAGED:
        return "sets managed (Unified) memory: fully synchronous with the host"
    return None


def operation_text(source: str) -> str:
    """The record's wording for a sync only CUPTI saw, around the user's source line."""
    return f"`{source}` made a CUDA call that blocks the host" if source else "a CUDA call that blocks the host"

"""Where a ``non_blocking`` copy goes: pure decisions, no torch calls.

The shim gathers the facts about a copy (:class:`CopyFacts`) and
:func:`route_copy` picks one of :data:`ROUTES`; the emulator asks
:func:`needs_emulated_wait`. Keeping this free of CUDA lets the unit tests
cover every branch on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

# What the shim does with a copy.
STAGE_FRESH = "stage_fresh"  # H2D into a new tensor, issued on the staging stream
STAGE_INTO = "stage_into"    # H2D into a staging tensor, then D2D into the target on the current stream
IN_PLACE = "in_place"        # H2D straight into a registered target, on the staging stream
OFFLOAD = "offload"          # D2H performed by the worker thread
ORIGINAL = "original"        # torch's own copy
ROUTES = (STAGE_FRESH, STAGE_INTO, IN_PLACE, OFFLOAD, ORIGINAL)


@dataclass(slots=True)
class CopyFacts:
    """What the shim knows about one copy call (made once per ``non_blocking`` copy, then only read).

    Not frozen: a frozen dataclass with these 14 fields takes 4.7 us to make on
    this project's CI machine against 1.1 us, on the path of every staged copy.

    Attributes:
        src_type: device type of the source (``"cpu"``, ``"cuda"``, ...).
        dst_type: device type of the destination.
        non_blocking: the caller passed ``non_blocking=True``.
        nbytes: bytes moved (the source's size).
        into_existing: ``copy_`` into a tensor the caller owns (vs a fresh result).
        registered_target: the destination is a registered in-place H2D target.
        dtype_changes: the copy converts the dtype.
        compiling: torch.compile is tracing.
        capturing: the stream the copy would use is capturing a CUDA graph.
        on_d2h_stream: the current stream of the source's device was made by ``new_d2h_stream``.
        strided: both tensors have the ordinary strided layout, and memory of their own (a ZeroTensor has
            none: its data pointer is 0, and only torch's copy knows it holds zeros).
        autograd: the source needs autograd tracking (requires grad, grad mode on).
        dual_level: a forward-mode AD level is open (a tensor may carry a tangent, which torch's copy carries over
            and allocates where it runs: on the staging stream, unmarked for the current stream's use).
        pageable_target: a D2H into an existing host tensor that is not pinned.
        noncontiguous_target: a D2H into an existing host tensor that is not contiguous.
        inference_target: a D2H into an inference tensor while inference mode is off (torch refuses it).
        complex_to_real: a D2H from a complex source into a real destination (torch warns that it drops
            the imaginary part).
    """

    src_type: str
    dst_type: str
    non_blocking: bool
    nbytes: int = 0
    into_existing: bool = False
    registered_target: bool = False
    dtype_changes: bool = False
    compiling: bool = False
    capturing: bool = False
    on_d2h_stream: bool = False
    strided: bool = True
    autograd: bool = False
    dual_level: bool = False
    pageable_target: bool = False
    noncontiguous_target: bool = False
    inference_target: bool = False
    complex_to_real: bool = False


def route_copy(facts: CopyFacts, max_staged_bytes: int) -> tuple[str, str]:
    """Return ``(route, reason)``; ``reason`` is empty unless ``route`` is ``ORIGINAL``.

    Order matters only for which reason is reported: compile tracing first
    (nothing may run that dynamo cannot trace), then the kind of copy, then
    graph capture, then the H2D/D2H specifics.
    """
    if facts.compiling:
        return ORIGINAL, "compiling"
    if not facts.non_blocking:
        return ORIGINAL, "blocking"
    src_cuda, dst_cuda = facts.src_type == "cuda", facts.dst_type == "cuda"
    if not src_cuda and not dst_cuda:
        return ORIGINAL, "no_cuda"
    if src_cuda and dst_cuda:
        return ORIGINAL, "device_to_device"
    if (facts.src_type if dst_cuda else facts.dst_type) != "cpu":
        return ORIGINAL, "other_device"
    if facts.capturing:
        return ORIGINAL, "capturing"
    if not facts.strided:
        return ORIGINAL, "layout"
    if dst_cuda:  # host -> device
        if facts.dual_level:
            # A tangent the staged copy made would live on the staging stream's memory, which only the result's own
            # storage is marked as used by the current stream for (found in review): torch's own copy.
            return ORIGINAL, "autograd"
        if facts.into_existing and facts.registered_target and not facts.dtype_changes:
            # The caller vouched that nothing reads the target: no staging memory, no size bound.
            return IN_PLACE, ""
        if facts.nbytes > max_staged_bytes:
            return ORIGINAL, "too_large"
        return (STAGE_INTO if facts.into_existing else STAGE_FRESH), ""
    # device -> host
    if not facts.on_d2h_stream:
        return ORIGINAL, "ordinary_stream"
    if facts.autograd:
        return ORIGINAL, "autograd"
    if facts.nbytes > max_staged_bytes:
        # An offloaded copy first snapshots its source on the GPU (docs/cc.md): the same bound as a staged H2D.
        return ORIGINAL, "too_large"
    if facts.inference_target:
        # torch raises at the call; the worker's copy would run later, elsewhere, and not raise at all.
        return ORIGINAL, "inference_target"
    if facts.complex_to_real:
        # torch warns at the call, on the caller's thread (where warnings filters and catch_warnings apply).
        return ORIGINAL, "complex_to_real"
    if facts.pageable_target:
        # torch's D2H into pageable memory has finished when the call returns (CUDA copies it synchronously), and
        # a program may rely on that; offloaded, the host would read it before the worker wrote it.
        return ORIGINAL, "pageable_target"
    if facts.noncontiguous_target:
        # torch copies into a contiguous temporary and then, on the host, into the target before it returns:
        # the target is written when the call returns, which a program may rely on (as for pageable memory).
        return ORIGINAL, "noncontiguous_target"
    return OFFLOAD, ""


def needs_emulated_wait(src_type: str, dst_type: str, non_blocking: bool, compiling: bool, capturing: bool) -> bool:
    """Return whether CC emulation must wait for the stream after this copy.

    Under CC every host<->device ``cudaMemcpyAsync`` returns only when its
    stream has drained. Blocking copies already wait; D2D and CPU-only copies
    are unaffected; nothing may wait while dynamo traces or a graph captures.
    """
    if not non_blocking or compiling or capturing:
        return False
    # One side CUDA, the other the host (a copy to ``meta`` or another backend moves no bytes across PCIe: found in
    # review, it waited).
    return {src_type, dst_type} == {"cuda", "cpu"}

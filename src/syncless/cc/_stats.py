"""Counters of what the shim did with each ``non_blocking`` host<->device copy."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

# Why a copy was left to torch's own path.
LEFT_ALONE_REASONS = (
    "blocking",          # non_blocking=False: never counted (a blocking copy goes beneath at once; docs/cc.md)
    "no_cuda",           # neither side is a CUDA tensor (CPU-only, meta, ...)
    "device_to_device",  # both sides on CUDA
    "other_device",      # the non-CUDA side is not the CPU (meta, ...)
    "compiling",         # torch.compile is tracing: never counted (a counter would be traced into the graph)
    "capturing",         # a CUDA graph is being captured
    "too_large",         # above SYNCLESS_CC_MAX_STAGED_BYTES (an H2D's staging tensor, a D2H's snapshot)
    "ordinary_stream",   # D2H on a stream not made by new_d2h_stream()
    "autograd",          # D2H of a tensor that autograd tracks
    "layout",            # sparse, nested or other non-strided tensors
    "pageable_target",   # D2H into pageable host memory: torch's copy is synchronous, so it stays torch's
    "noncontiguous_target",  # D2H into a non-contiguous host tensor: torch writes it on the host before returning
    "inference_target",  # D2H into an inference tensor outside inference mode: torch refuses it at the call
    "complex_to_real",   # D2H that drops an imaginary part: torch warns at the call, on the caller's thread
    "idle_stream",       # H2D .to() while nothing is queued on the current stream: torch's copy waits for it alone
)


@dataclass(frozen=True)
class CopyStats:
    """A snapshot of the counters.

    Attributes:
        staged: H2D copies issued on a staging stream (fresh results and copies into existing tensors).
        inlined: small H2D copies written by a kernel from its launch parameters, on the current stream
            (no transfer to wait for, under CC or not; docs/cc.md, "Small uploads").
        in_place: H2D copies into registered targets, issued directly on the staging stream.
        offloaded: D2H copies handed to the worker thread.
        to_helper: of those, copies made by the D2H helper process (``SYNCLESS_CC_D2H_HELPER``).
        emulated_waits: host waits the CC emulation added after a copy.
        left_alone: copies kept on torch's own path, by reason.
        bypass_waits: host waits before a host<->device copy that bypasses ``Tensor.to/cuda/copy_``
            (``h[:] = x``, ``new_tensor``, ``torch.as_tensor``, ``torch.asarray``, ``UntypedStorage.copy_``)
            issued on a D2H stream
            with offloaded copies pending, for those copies (docs/cc.md).
    """

    staged: int = 0
    in_place: int = 0
    inlined: int = 0
    offloaded: int = 0
    to_helper: int = 0
    emulated_waits: int = 0
    left_alone: dict[str, int] = field(default_factory=dict)
    bypass_waits: int = 0

    @property
    def total_left_alone(self) -> int:
        return sum(self.left_alone.values())


class StatsCounter:
    """Thread-safe counters behind :func:`syncless.cc.stats`."""

    _FIELDS = ("staged", "in_place", "inlined", "offloaded", "to_helper", "emulated_waits", "bypass_waits")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._left: Counter[str] = Counter()

    def add(self, name: str, count: int = 1) -> None:
        """Count ``count`` events of ``name`` (one of the :class:`CopyStats` integer fields)."""
        if name not in self._FIELDS:
            raise ValueError(f"unknown counter {name!r}; expected one of {', '.join(self._FIELDS)}")
        with self._lock:
            self._counts[name] += count

    def left_alone(self, reason: str) -> None:
        """Count one copy left on torch's path because of ``reason``."""
        if reason not in LEFT_ALONE_REASONS:
            raise ValueError(f"unknown reason {reason!r}; expected one of {', '.join(LEFT_ALONE_REASONS)}")
        with self._lock:
            self._left[reason] += 1

    def read_back_at_call(self, emulated: bool) -> None:
        """Count one small readback read at the call (``left_alone["idle_stream"]``) and, if CC is emulated, the
        wait it made (``emulated_waits``): the readback of every decode step, so one call and one lock, not two."""
        with self._lock:
            self._left["idle_stream"] += 1
            if emulated:
                self._counts["emulated_waits"] += 1

    def snapshot(self) -> CopyStats:
        """Return the counters as they are now."""
        with self._lock:
            return CopyStats(**{f: self._counts[f] for f in self._FIELDS}, left_alone=dict(self._left))

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            self._counts.clear()
            self._left.clear()


COUNTERS = StatsCounter()

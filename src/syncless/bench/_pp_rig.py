"""What one ``syncless bench pp`` worker holds, and the small helpers every section shares.

A :class:`Rig` is one rank's view: its GPU, the groups (a gloo group for the
benchmark's own barriers and object exchange, an NCCL group for the NCCL
baseline), the transports under test, the raw peer buffers and the
:class:`Reporter` that sends progress and results to the parent process.
Rank 0 is always the sending stage of the forward direction, rank 1 the
receiving one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from syncless.bench._pp_cuda import Gate, PeerBuffer, SpinKernel, sync_device
from syncless.bench._pp_plan import HIDDEN, TENSOR_NAMES, Plan

#: Largest gate (host head start) any timed loop may ask for.
MAX_GATE_MS = 2000.0


class Reporter:
    """Sends messages from a worker to the parent over a multiprocessing queue.

    Messages are tuples of plain data: ``("progress", rank, text)``,
    ``("result", rank, path, value)``, ``("done", rank)``,
    ``("error", rank, text)``, ``("note", rank, text)``.
    """

    def __init__(self, rank: int, queue: Any):
        self.rank = rank
        self.queue = queue

    def progress(self, text: str) -> None:
        self.queue.put(("progress", self.rank, text))

    def result(self, path: Sequence[Any], value: Any) -> None:
        """Store ``value`` at ``path`` (a key sequence) in the parent's results."""
        self.queue.put(("result", self.rank, tuple(path), value))

    def note(self, text: str) -> None:
        """Add a line to the report's notes."""
        self.queue.put(("note", self.rank, text))

    def done(self) -> None:
        self.queue.put(("done", self.rank))

    def error(self, text: str) -> None:
        self.queue.put(("error", self.rank, text))


@dataclass
class Rig:
    """One rank's benchmark state. ``fwd`` moves rank 0 -> 1, ``bwd`` rank 1 -> 0 (None if unavailable)."""

    rank: int
    device: Any
    plan: Plan
    report: Reporter
    cpu_group: Any
    nccl_group: Any
    gate: Gate
    fwd: Any = None
    bwd: Any = None
    #: the same two directions built with depth=0 (sender copies straight into the persistent tensors)
    fwd0: Any = None
    bwd0: Any = None
    #: the same two directions built with depth="auto" (each step direct or through a slot; opt-in until measured)
    fwda: Any = None
    bwda: Any = None
    raw: PeerBuffer | None = None
    spin: SpinKernel | None = None
    #: the receiving side's persistent tensors: "fwd"/"fwd0"/"fwda" on rank 1, "bwd"/"bwd0"/"bwda" on rank 0
    persistent: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: last value written to the raw ping-pong flags (the same count on both ranks)
    flag_seq: int = 0
    #: a created stream for the ``@own`` latency runs (made on first use)
    own_stream: Any = None

    @property
    def peer(self) -> int:
        return 1 - self.rank

    @property
    def sender(self) -> bool:
        """Rank 0 sends in the forward direction."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for the other rank (gloo; blocks the host, touches no stream)."""
        import torch.distributed as dist

        dist.barrier(group=self.cpu_group)

    def share(self, value: Any, src: int) -> Any:
        """Return rank ``src``'s ``value`` on both ranks (gloo broadcast of a picklable object)."""
        import torch.distributed as dist

        box = [value if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Return ``[rank 0's value, rank 1's value]`` on both ranks."""
        import torch.distributed as dist

        out: list[Any] = [None, None]
        dist.all_gather_object(out, value, group=self.cpu_group)
        return out

    def sync(self, what: str) -> None:
        """Wait for all of this GPU's work, or raise after the plan's GPU timeout."""
        sync_device(self.device, self.plan.gpu_wait_timeout_s, what)


class GateTuner:
    """The gate length for one timed loop: doubled whenever the host did not get ahead.

    It grows to at most ``growth`` times its first length and never past
    :data:`MAX_GATE_MS`.
    """

    def __init__(self, initial_ms: float, growth: float = 8.0):
        self.max_ms = min(initial_ms * growth, MAX_GATE_MS)
        self.ms = min(initial_ms, self.max_ms)

    def update(self, ahead: bool) -> None:
        if not ahead:
            self.ms = min(self.ms * 2.0, self.max_ms)


def median(values: Sequence[float]) -> float:
    """Median, or NaN for no values."""
    return float(statistics.median(values)) if values else float("nan")


def mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else float("nan")


# Payloads --------------------------------------------------------------------------


def pattern(numel: int, seed: int, device: Any) -> Any:
    """Return ``numel`` pseudo-random int16 values, the same on every GPU for the same seed.

    An integer hash of the index (not torch's RNG), so the receiving rank can
    regenerate exactly what the sender sent and compare bit for bit.
    """
    import torch

    x = torch.arange(numel, device=device, dtype=torch.int64) + seed * 1_000_003
    x = (x & 0x7FFFFFFF) * 2654435761  # < 2**63: no signed overflow
    x = x ^ (x >> 15)
    x = (x & 0xFFFFFFFF) * 1274126177  # < 2**63 as well
    x = x ^ (x >> 13)
    return ((x & 0xFFFF) - 32768).to(torch.int16)


def make_payload(rows: int, seed: int, device: Any) -> dict[str, Any]:
    """Return ``{"hidden", "residual"}``: fresh pseudo-random bf16 ``[rows, HIDDEN]`` tensors."""
    import torch

    return {
        name: pattern(rows * HIDDEN, seed * len(TENSOR_NAMES) + i, device).view(torch.bfloat16).view(rows, HIDDEN)
        for i, name in enumerate(TENSOR_NAMES)
    }


def empty_payload(rows: int, device: Any, own_allocation: bool = False) -> dict[str, Any]:
    """Return poisoned (all bits set) bf16 ``[rows, HIDDEN]`` tensors to receive into.

    ``own_allocation``: in an allocation that holds nothing else (what ``depth=0`` needs).
    """
    import torch

    if own_allocation:
        from syncless.pp import alloc_persistent

        tensors = alloc_persistent({name: ((rows, HIDDEN), torch.bfloat16) for name in TENSOR_NAMES}, device)
    else:
        tensors = {name: torch.empty(rows, HIDDEN, dtype=torch.bfloat16, device=device) for name in TENSOR_NAMES}
    poison(tensors)
    return tensors


def poison(tensors: dict[str, Any]) -> None:
    """Set every bit of ``tensors`` on the current stream, so stale data cannot pass a check."""
    import torch

    for tensor in tensors.values():
        tensor.view(torch.int16).fill_(-1)


def same_bits(got: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Return whether every tensor of ``got`` equals ``expected`` bit for bit (synchronizes the host)."""
    import torch

    for name in TENSOR_NAMES:
        a, b = got[name], expected[name]
        if tuple(a.shape) != tuple(b.shape):
            return False
        if not torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16)):
            return False
    return True


def views(out: Any) -> dict[str, Any]:
    """Index every tensor of a transport's ``recv()`` result (this orders any lazy wait on the current stream)."""
    return {name: out[name] for name in TENSOR_NAMES}


# NCCL baseline ---------------------------------------------------------------------


def nccl_send(rig: Rig, tensors: dict[str, Any]) -> list[Any]:
    """Enqueue NCCL sends of every tensor to the peer as one batch; return the works. Does not block the host."""
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, tensors[name], rig.peer, group=rig.nccl_group) for name in TENSOR_NAMES]
    return dist.batch_isend_irecv(ops)


def nccl_recv(rig: Rig, tensors: dict[str, Any]) -> list[Any]:
    """Enqueue NCCL receives into every tensor as one batch; return the works (not yet waited)."""
    import torch.distributed as dist

    ops = [dist.P2POp(dist.irecv, tensors[name], rig.peer, group=rig.nccl_group) for name in TENSOR_NAMES]
    return dist.batch_isend_irecv(ops)


def wait_all(works: list[Any]) -> None:
    """Make the current stream wait for every work (NCCL: a stream wait; the host does not block)."""
    for work in works:
        work.wait()


def nccl_warmup(rig: Rig) -> None:
    """Connect NCCL in both directions with one batch per rank (send and receive posted together).

    NCCL connects a pair lazily at the first send/recv and blocks the host
    until the peer posts its side; a single batch holding both directions on
    each rank cannot deadlock, and no barrier sits between them.
    """
    import torch
    import torch.distributed as dist

    out = torch.full((1024,), float(rig.rank + 1), device=rig.device)
    into = torch.zeros(1024, device=rig.device)
    ops = [
        dist.P2POp(dist.isend, out, rig.peer, group=rig.nccl_group),
        dist.P2POp(dist.irecv, into, rig.peer, group=rig.nccl_group),
    ]
    wait_all(dist.batch_isend_irecv(ops))
    rig.sync("NCCL warm-up")
    if float(into[0].item()) != float(rig.peer + 1):
        raise RuntimeError(f"NCCL warm-up delivered {into[0].item()} instead of {rig.peer + 1}")

"""The copy-engine transport: CUDA IPC buffers, peer copies, and 64-bit flags awaited on the GPU.

Buffers. Every stage allocates one IPC-shareable buffer (zeroed before its
handle is shared) holding ``depth`` receive slots, each laid out like its
persistent tensors (:class:`~syncless.pp._layout.Ring`)::

    [ full: u64 | empty: u64 | pad to 256 | slot 0 | slot 1 | ... | slot depth-1 ]

``full`` is written by the previous stage (the last step delivered), ``empty``
by the next stage (the last step consumed): each flag lives on the GPU that
waits on it, and both only grow (64-bit step counters, never reused). A stage
that sends also owns a local send buffer of ``depth`` slots laid out like the
next stage's. Step N = 1, 2, ... uses slot s = (N - 1) % D on both sides
(D = depth)::

    sender current:   [wait copied[s] if N > D] pack rows -> send slot s, (packed)
    sender side:      wait packed, (pre) [wait empty >= N-D if N > D],
                      copy send slot s -> peer slot s (copy engine), write peer.full = N, (post) (copied[s])
    receiver current: ...earlier work... (pre) wait full >= N,
                      copy peer slot s -> persistent, write sender.empty = N (post)

Within a slot a step is packed densely: tensor after tensor in layout
order, each starting on the next 256-byte boundary after the previous one's
rows (``_layout.dense_spans``). The sender takes the offsets from its row
counts, the receiver from the same counts in the step's metadata, so the peer
copy is one ``cuMemcpyAsync`` of ``[0, end)`` per step whatever the number of
tensors. Each offset is at most the tensor's offset at maximum rows, so a
step always fits its slot; the few padding bytes between tensors travel
along and are never read.

So up to D steps are in flight per link, and the three pieces of work of
neighbouring steps overlap. With D = 2, when pack, peer copy and unpack take
about as long as each other::

    time ->           | t1     | t2     | t3       | t4       | t5       |
    sender current    | pack 1 | pack 2 | pack 3   | pack 4   | pack 5   |
    sender side       |        | copy 1 | copy 2   | copy 3   | copy 4   |
    receiver current  |        |        | unpack 1 | unpack 2 | unpack 3 |
                                          pack N+1 || copy N || unpack N-1

(pack 3 reuses send slot 0 once copy 1 is done; copy 3 reuses peer slot 0
once unpack 1 is done: both ended in t3 at the latest.) With D = 1 each step
pays pack + copy + unpack back to back. A larger D absorbs jitter (a long
kernel ahead of one unpack) at the price of D slots of memory on each side.

Why each ordering is safe:
- The caller may overwrite its tensors once send() returns: they are read by
  the pack, which is on the caller's current stream, before anything the
  caller enqueues later.
- Send slot s is rewritten (pack N) only after ``copied[s]``: its latest record
  when send(N) runs is the one send(N-D) made after the peer copy of step N-D,
  the last step that read slot s (the host enqueues steps in order, and
  ``cuStreamWaitEvent`` waits for the record made before it was called).
- Peer slot s is rewritten (copy N) only after ``empty >= N-D``: the receiver
  writes ``empty = N-D`` on its stream after its copy of step N-D out of slot
  s, the last read of that slot before step N; a larger value is written
  later still. Steps N-D+1 .. N-1 use the other slots, so they may be in
  flight at the same time.
- The receiver reads slot s only after ``full >= N``: the sender writes
  ``full = N`` on its side stream after the copies of step N (and, in stream
  order, of every earlier step); over NVLink the data lands before the flag
  write that follows it (why PCIe peers are refused), and on one GPU it is
  local memory in stream order. Step N+D, the next writer of slot s, cannot
  start before the receiver wrote ``empty = N`` (previous point).
- The persistent tensors are rewritten on the receiver's current stream,
  after whatever the caller queued there before recv() (readers of the last
  step included), and the caller's later work sees the new rows.

Host cost per step: a handful of driver calls, no host sync and no GPU
allocation. The driver calls are bound once (``_driver.Hot``: results
checked inline, a failure raises the same ``CudaError`` as ``cuda.call``),
and the primary context is pushed only when the calling thread does not
already have it current (``_driver.ThreadBinding``: checked with the driver
once per thread, then with torch's current device). Step validation uses
expectations worked out at set-up (``_layout.StepCheck``). The per-slot
``copied`` events and the ``packed`` event are made at set-up; the watchdog's bracket events come from a pool that only grows
while more steps are in flight than ever before. The receiver's ``empty``
write is one ``cuStreamWriteValue64`` per step; it is what frees a slot, so
batching it would stall the sender.

Metadata (N and the row counts) goes over the CPU group with ``isend`` from a
ring of reusable CPU tensors (``_MetaSlot``, at least ``META_RING``): send(N)
first waits for the isend of the step that last used its tensor, which on
gloo has long gone out unless the next stage's host is that many steps
behind (then it is back-pressure, bounded by the timeout). The receiver
reuses one buffer. The host never waits for the GPU. A watchdog
(``_watchdog.py``) bounds every GPU-side wait; the metadata receive has a host timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections import deque
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from syncless._core import cuda as cuda_core
from syncless._core.errors import CopyEngineUnavailable, PeerTimeoutError
from syncless.pp import _driver as drv
from syncless.pp._base import Transport
from syncless.pp._eligibility import StageDevice, local_stage_device, mem_ops_problem, query_nvlink, topology_problem
from syncless.pp._group import StageMap, agree, barrier, recv_meta
from syncless.pp._layout import Layout, Ring, StepCheck, TensorSpec, dense_spans
from syncless.pp._watchdog import Bracket, Watchdog

logger = logging.getLogger(__name__)

FULL_OFFSET = 0
EMPTY_OFFSET = 8
REGION_OFFSET = 256

INJECTABLE_FAILURES = ("mem_ops", "peer_open")


def open_copy_engine(
    *,
    side_group: Any,
    stages: StageMap,
    tag: int,
    specs: list[dict[str, TensorSpec]],
    persistent: Mapping[str, torch.Tensor],
    device: torch.device,
    timeout_s: float,
    depth: int,
    inject_failure: str | None,
) -> CopyEngineTransport:
    """Set up the copy-engine transport; collective over the stages.

    Every stage passes the same ``depth`` (``make_transport`` checked it):
    the receive and send buffers hold ``depth`` slots each. Blocks the host
    for three exchanges over the CPU group. Any failure on
    any rank raises the same exception on every rank, after every rank has
    unmapped and freed what it made.

    Raises:
        CopyEngineUnavailable: some stage cannot use copy engines (the message names the first).
    """
    stack = contextlib.ExitStack()
    with stack:
        # Step 1: what each rank can tell alone (CUDA, memory ops).
        def local_checks() -> StageDevice:
            if inject_failure == "mem_ops":
                raise CopyEngineUnavailable("64-bit stream memory operations refused (injected failure for tests)")
            if device.type != "cuda":
                raise CopyEngineUnavailable(f"this stage's tensors are on {device}, not a CUDA GPU")
            problem = mem_ops_problem(device.index)
            if problem:
                raise CopyEngineUnavailable(problem)
            return local_stage_device(device.index)

        devices = agree(side_group, stages, "copy-engine set-up", local_checks)

        ctx = drv.PrimaryContext(device.index)
        stack.callback(ctx.release)
        parts = _Parts(ctx)
        recv_ring = Ring(Layout.from_specs(specs[stages.index]), depth)
        send_ring = Ring(Layout.from_specs(specs[stages.index + 1]), depth) if stages.next_rank is not None else None

        # Step 2: topology (every pair of GPUs on NVLink), then allocate and export.
        def local_allocate() -> bytes:
            try:
                problem = topology_problem(devices, query_nvlink)
            except cuda_core.nvml_errors() as err:
                raise CopyEngineUnavailable(f"NVML could not tell whether the GPUs are NVLink-connected: {err}") from err
            if problem:
                raise CopyEngineUnavailable(problem)
            with ctx:
                parts.private_stream = drv.stream_create()
                stack.callback(_in(ctx, drv.stream_destroy), parts.private_stream)
                parts.side_stream = drv.stream_create()
                stack.callback(_in(ctx, drv.stream_destroy), parts.side_stream)
                stack.callback(_in(ctx, parts.destroy_events))
                parts.buffer = drv.mem_alloc(REGION_OFFSET + recv_ring.nbytes)
                stack.callback(_in(ctx, drv.mem_free), parts.buffer)
                drv.mem_zero(parts.buffer, REGION_OFFSET + recv_ring.nbytes, parts.private_stream)
                if send_ring is not None:
                    parts.send_buffer = drv.mem_alloc(send_ring.nbytes)
                    stack.callback(_in(ctx, drv.mem_free), parts.send_buffer)
                parts.packed = parts.acquire_event()
                parts.copied = [parts.acquire_event() for _ in range(depth)]
                # The flags must read 0 before any peer can see the handle.
                drv.stream_synchronize(parts.private_stream)
                return drv.ipc_handle(parts.buffer)

        handles = agree(side_group, stages, "copy-engine set-up", local_allocate)
        # From here peers may map our buffer: nobody frees before everybody unmapped.
        stack.callback(barrier, side_group, timeout_s, "copy-engine tear-down")

        # Step 3: map the neighbours' buffers.
        def local_open() -> None:
            if inject_failure == "peer_open":
                raise CopyEngineUnavailable("opening the peer's CUDA IPC handle failed (injected failure for tests)")
            with ctx:
                for neighbour in (stages.index - 1, stages.index + 1):
                    if 0 <= neighbour < len(stages.ranks):
                        base = drv.ipc_open(handles[neighbour])
                        stack.callback(_in(ctx, drv.ipc_close), base)
                        parts.peer_base[neighbour] = base

        agree(side_group, stages, "copy-engine set-up", local_open)
        owned = stack.pop_all()
    try:
        return CopyEngineTransport(
            stack=owned,
            parts=parts,
            side_group=side_group,
            stages=stages,
            tag=tag,
            recv_ring=recv_ring,
            send_ring=send_ring,
            persistent=dict(persistent),
            device=device,
            timeout_s=timeout_s,
        )
    except BaseException:
        owned.close()  # nothing stays allocated or mapped if the object itself cannot be built
        raise


#: Metadata tensors a sender cycles through; send(N) reuses the one of step N - META_RING (or N - 2 * depth).
META_RING = 8

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    """Return the handle of torch's current stream on GPU ``index`` (an int; 0 is the legacy default stream)."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


class _MetaSlot:
    """One reusable CPU int64 tensor for a step's metadata ``[N, rows...]`` and its pending ``isend``.

    Values are written through a ctypes view of the tensor's memory (no new
    tensor per step). The tensor is rewritten only after :meth:`reclaim`
    waited for its previous ``isend``. (Reading torch's ProcessGroupGloo, a
    send work is marked complete only inside ``wait()``, so polling
    ``is_completed()`` never frees it; the old reaping never did.)
    """

    __slots__ = ("tensor", "view", "work")

    def __init__(self, length: int):
        self.tensor = torch.zeros(length, dtype=torch.int64)
        self.view = (ctypes.c_int64 * length).from_address(self.tensor.data_ptr())
        self.work: Any = None

    def reclaim(self, timeout: timedelta) -> None:
        """Block until the previous ``isend`` of this tensor went out (at most ``timeout``)."""
        work, self.work = self.work, None
        if work is not None:
            work.wait(timeout=timeout)

    def send(self, step: int, rows: list[int], dst: int, group: Any, tag: int) -> None:
        """Write ``[step, *rows]`` and start a non-blocking ``isend`` of it (call :meth:`reclaim` first)."""
        import torch.distributed as dist

        self.view[0] = step
        self.view[1:] = rows
        self.work = dist.isend(self.tensor, dst=dst, group=group, tag=tag)


def _in(ctx: drv.PrimaryContext, fn: Any) -> Any:
    def run(*args: Any) -> None:
        with ctx:
            fn(*args)

    return run


class _Parts:
    """What set-up made, handed to the transport."""

    def __init__(self, ctx: drv.PrimaryContext):
        self.ctx = ctx
        self.private_stream = 0
        self.side_stream = 0
        self.buffer = 0
        self.send_buffer = 0
        self.peer_base: dict[int, int] = {}
        self.packed: drv.Event | None = None
        self.copied: list[drv.Event] = []  # one per send slot, never recycled
        self.events: list[drv.Event] = []  # every event ever created, destroyed at the end
        self.free_events: deque[drv.Event] = deque()
        self.lock = threading.Lock()

    def acquire_event(self) -> drv.Event:
        """Return a free event (the context must be current)."""
        try:
            return self.free_events.popleft()  # deque operations are atomic: no lock on the hot path
        except IndexError:
            pass
        event = drv.Event()
        with self.lock:
            self.events.append(event)
        return event

    def recycle_event(self, event: drv.Event) -> None:
        self.free_events.append(event)

    def destroy_events(self) -> None:
        with self.lock:
            events, self.events = self.events, []
            self.free_events.clear()
        for event in events:
            event.destroy()


class CopyEngineTransport(Transport):
    """Pipeline transport over copy engines; built by ``make_transport``. See the module docstring.

    Attributes:
        depth: steps that may be in flight on each link (slots per buffer).
    """

    backend = "copy_engine"

    def __init__(
        self,
        *,
        stack: contextlib.ExitStack,
        parts: _Parts,
        side_group: Any,
        stages: StageMap,
        tag: int,
        recv_ring: Ring,
        send_ring: Ring | None,
        persistent: dict[str, torch.Tensor],
        device: torch.device,
        timeout_s: float,
    ):
        self.device = device
        self.fallback_reason = None
        self.depth = recv_ring.depth
        self._stack = stack
        self._parts = parts
        self._ctx = parts.ctx
        self._side_group = side_group
        self._stages = stages
        self._tag = tag
        self._recv_ring = recv_ring
        self._recv_layout = recv_ring.layout
        self._send_ring = send_ring
        self._send_layout = send_ring.layout if send_ring is not None else None
        self._persistent = persistent
        self._timeout_s = timeout_s
        self._send_step = 0
        self._recv_step = 0
        self._failure: BaseException | None = None
        self._closed = False
        self._full = parts.buffer + FULL_OFFSET
        self._empty = parts.buffer + EMPTY_OFFSET
        self._region = parts.buffer + REGION_OFFSET
        nxt, prv = stages.index + 1, stages.index - 1
        self._next_full = parts.peer_base[nxt] + FULL_OFFSET if nxt in parts.peer_base else 0
        self._prev_empty = parts.peer_base[prv] + EMPTY_OFFSET if prv in parts.peer_base else 0
        # Slot addresses, computed once: send() and recv() only index these lists.
        self._recv_slots = [self._region + recv_ring.slot_offset(k) for k in range(self.depth)]
        if send_ring is not None and nxt in parts.peer_base:
            next_region = parts.peer_base[nxt] + REGION_OFFSET
            offsets = [send_ring.slot_offset(k) for k in range(self.depth)]
            self._send_slots = [parts.send_buffer + off for off in offsets]
            self._next_slots = [next_region + off for off in offsets]
        else:
            self._send_slots = self._next_slots = []
        self._watchdog = Watchdog(timeout_s, self._on_timeout, parts.recycle_event, self._ctx.make_current)
        # Per-step constants, worked out once so send() and recv() do only what changes per step.
        self._hot = drv.Hot()
        self._binding = drv.thread_binding(self._ctx)
        self._index = device.index
        torch.cuda.current_stream(device)  # torch's CUDA state is initialised before the raw lookups below
        self._wait_timeout = timedelta(seconds=timeout_s)
        self._recv_row_nbytes = [spec.row_nbytes for spec in self._recv_layout.specs.values()]
        self._recv_targets = [(name, persistent[name].data_ptr()) for name in self._recv_layout.specs]
        self._recv_meta = torch.empty(1 + len(self._recv_layout.specs), dtype=torch.int64)
        self._recv_what = f"{stages.name()} receiving step"
        if self._send_layout is not None:
            self._send_check = StepCheck(self._send_layout.specs, device, stages.name(stages.index + 1))
            self._send_row_nbytes = [spec.row_nbytes for spec in self._send_layout.specs.values()]
            self._send_names = self._send_layout.names
            self._send_what = f"send step {{}} to {stages.name(stages.index + 1)}"
            self._metas = [_MetaSlot(1 + len(self._send_names)) for _ in range(max(META_RING, 2 * self.depth))]

    # -- sending ---------------------------------------------------------------------

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Send one step to the next stage.

        Enqueues the pack on the caller's current stream of this stage's GPU
        and the peer copy on a private side stream; blocks the host for
        neither (only for a non-blocking metadata ``isend``, and, when the
        host runs ``len(metas)`` steps ahead of the next stage's host, until
        the oldest metadata went out). The caller may overwrite ``tensors``
        as soon as this returns.

        Raises:
            ValueError, TypeError: the step does not fit the next stage's layout (nothing was enqueued).
            PeerTimeoutError: an earlier step timed out, or the next stage took no metadata within the
                timeout; the transport is unusable.
        """
        if self._closed or self._failure is not None:
            self._check_usable()
        if self._send_layout is None:
            raise RuntimeError(f"{self._stages.name()} is the last stage: it has no next stage to send to")
        rows = self._send_check.rows(tensors)
        step = self._send_step + 1
        meta = self._metas[step % len(self._metas)]
        self._meta_free(meta, step)  # before any GPU work: a failure leaves no half-sent step
        depth = self.depth
        slot = (step - 1) % depth
        send_slot, peer_slot = self._send_slots[slot], self._next_slots[slot]
        spans, total = dense_spans(self._send_row_nbytes, rows)
        # Non-contiguous inputs become contiguous temporaries on the current stream. `dense` holds
        # them until every pack copy is enqueued; after that, freeing is safe: the caching allocator
        # reuses a block on the current stream only behind the copies already enqueued there.
        dense = [tensors[name].contiguous() for name in self._send_names]
        sources = [t.data_ptr() for t in dense]
        parts, hot, side = self._parts, self._hot, self._parts.side_stream
        copied = parts.copied[slot]
        pushed = self._binding.enter()
        try:
            current = _current_stream(self._index)
            if step > depth:
                hot.wait_event(copied, current)  # the peer copy of step N-D read this send slot last
            for source, (offset, nbytes) in zip(sources, spans):
                if nbytes:
                    hot.memcpy(send_slot + offset, source, nbytes, current)
            hot.record(parts.packed, current)
            hot.wait_event(parts.packed, side)
            pre, post = parts.acquire_event(), parts.acquire_event()
            hot.record(pre, side)
            if step > depth:
                hot.wait_geq(side, self._empty, step - depth)  # the receiver is done with step N-D
            if total:
                hot.memcpy(peer_slot, send_slot, total, side)  # the whole step: one copy-engine transfer
            hot.write(side, self._next_full, step)
            hot.record(post, side)
            hot.record(copied, side)
        except BaseException as err:
            self._fail_mid_step(f"sending step {step}", err)
            raise
        finally:
            self._binding.exit(pushed)
        self._watchdog.watch(Bracket(side, pre, post, self._send_what.format(step)))
        meta.send(step, rows, self._stages.next_rank, self._side_group, self._tag)
        self._send_step = step

    def _meta_free(self, meta: _MetaSlot, step: int) -> None:
        """Wait (at most the timeout) until ``meta``'s previous isend went out; usually it long has."""
        try:
            meta.reclaim(self._wait_timeout)
        except RuntimeError as err:
            self._failure = PeerTimeoutError(
                f"{self._stages.name()} sending step {step}: the metadata of step {step - len(self._metas)} "
                f"did not go out within {self._timeout_s:g} s; the next stage died or stopped receiving: {err}"
            )
            raise self._failure from err

    def _finish_meta(self) -> None:
        for meta in getattr(self, "_metas", ()):
            try:
                meta.reclaim(self._wait_timeout)
            except RuntimeError as err:
                logger.warning("%s: metadata not delivered before close(): %s", self._stages.name(), err)
                return

    # -- receiving -------------------------------------------------------------------

    def recv(self) -> dict[str, torch.Tensor]:
        """Receive the next step into the persistent tensors; return views with this step's rows.

        Blocks the host until the step's metadata arrives (at most the
        timeout), then enqueues on the caller's current stream of this
        stage's GPU: wait for the data, copy it into the persistent tensors,
        tell the sender the region is free. Earlier work on that stream
        overlaps the transfer; later work sees the data.

        Raises:
            PeerTimeoutError: the previous stage sent nothing within the timeout, or an earlier step timed out.
        """
        if self._closed or self._failure is not None:
            self._check_usable()
        if self._stages.prev_rank is None:
            raise RuntimeError(f"{self._stages.name()} is the first stage: it has no previous stage to receive from")
        layout = self._recv_layout
        step = self._recv_step + 1
        try:
            meta = recv_meta(
                self._side_group, self._stages.prev_rank, self._tag, len(self._recv_meta), self._timeout_s,
                f"{self._recv_what} {step}", out=self._recv_meta,
            ).tolist()
        except PeerTimeoutError as err:
            self._failure = err
            raise
        rows = meta[1:]
        if meta[0] != step or not all(0 <= r <= spec.max_rows for r, spec in zip(rows, layout.specs.values())):
            self._failure = RuntimeError(
                f"{self._recv_what} {step}: the peer's metadata {meta} does not match (protocol error)"
            )
            raise self._failure
        spans, _ = dense_spans(self._recv_row_nbytes, rows)
        parts, hot = self._parts, self._hot
        slot_base = self._recv_slots[(step - 1) % self.depth]
        pushed = self._binding.enter()
        try:
            current = _current_stream(self._index)
            pre, post = parts.acquire_event(), parts.acquire_event()
            hot.record(pre, current)
            hot.wait_geq(current, self._full, step)
            for (_name, target), (offset, nbytes) in zip(self._recv_targets, spans):
                if nbytes:
                    hot.memcpy(target, slot_base + offset, nbytes, current)
            hot.write(current, self._prev_empty, step)
            hot.record(post, current)
        except BaseException as err:
            self._fail_mid_step(f"receiving step {step}", err)
            raise
        finally:
            self._binding.exit(pushed)
        self._watchdog.watch(Bracket(current, pre, post, f"{self._recv_what} {step}"))
        self._recv_step = step
        persistent = self._persistent
        return {name: persistent[name][:count] for name, count in zip(layout.specs, rows)}

    # -- failure and tear-down -------------------------------------------------------------

    def _fail_mid_step(self, what: str, err: BaseException) -> None:
        """A driver call failed with part of a step enqueued: the flags no longer match the steps, so stop."""
        if self._failure is None:
            failure = RuntimeError(f"{self._stages.name()} {what}: {err}; part of the step was enqueued, so this "
                                   "transport is unusable: close() it")
            failure.__cause__ = err
            self._failure = failure

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this transport is closed")
        if self._failure is not None:
            raise self._failure

    def _on_timeout(self, what: str, waited_s: float) -> None:
        """Watchdog thread: record the error and release every wait on our flags (runs once)."""
        err = PeerTimeoutError(
            f"{what}: the GPU waited {waited_s:.1f} s for the peer's flag (timeout {self._timeout_s:g} s); the peer "
            "died or stopped. The waits were released; that step's received data is undefined (bytes 0xFF). "
            "This transport is unusable: close() it."
        )
        if self._failure is None:
            self._failure = err
        logger.error("%s", err)
        parts = self._parts
        stream = parts.private_stream
        if self._stages.prev_rank is not None:
            drv.mem_fill_bytes(self._region, 0xFF, self._recv_ring.nbytes, stream)  # every slot
        drv.write_value(stream, self._full, drv.RELEASE_VALUE)
        drv.write_value(stream, self._empty, drv.RELEASE_VALUE)

    def close(self) -> None:
        """Wait for this stage's queued transfers, then unmap and free everything; every stage calls it.

        Blocks the host: until the GPU finished every enqueued step (stuck
        waits are released by the watchdog after the timeout), and for two
        barriers with the other stages (so no buffer is freed while a peer
        still maps it; a dead peer only costs a logged warning).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._watchdog.wait_idle()
        finally:
            self._watchdog.stop()
            self._finish_meta()
            # The stack unmaps the peers' buffers, waits for every stage, then frees ours.
            barrier(self._side_group, self._timeout_s, "copy-engine close")
            self._stack.close()

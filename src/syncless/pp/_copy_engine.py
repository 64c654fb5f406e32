"""The copy-engine transport: CUDA IPC buffers, peer copies, and 64-bit flags awaited on the GPU.

This module is the protocol and the per-step calls; ``_copy_engine_setup``
builds the transport (buffers, mappings, sockets) collectively, and
``_copy_engine_end`` handles its failures and its end (``close``, ``abort``).

Buffers. Every stage allocates one IPC-shareable buffer (whole 2 MiB pages,
so that no other memory of the process shares a page with it; zeroed before
its handle is shared) holding ``depth`` receive slots, each laid out like its
persistent tensors (:class:`~syncless.pp._layout.Ring`)::

    [ full: u64 | empty: u64 | scratch: 32 bytes | pad to 256 | slot 0 | slot 1 | ... | slot depth-1 ]

(``scratch`` stays zero: set-up copies zeros over zeros there to try batched
copies.) ``full`` is written by the previous stage (the last step delivered), ``empty``
by the next stage (the last step consumed): each flag lives on the GPU that
waits on it, and both only grow (64-bit step counters, never reused). Step
N = 1, 2, ... uses slot s = (N - 1) % D on both sides (D = depth)::

    sender relay:     (pre) [wait empty >= N-D if N > D], then after the caller's work (relay, below):
                      copy each tensor's rows -> peer slot s (copy engine), write peer.full = N (post)
    receiver current: ...earlier work... (pre) wait full >= N,
                      copy own slot s -> persistent, write sender.empty = N (post)

Within a slot a step is placed densely: tensor after tensor in layout
order, each starting on the next 256-byte boundary after the previous one's
rows (``_layout.dense_spans``). The sender takes the offsets from its row
counts, the receiver from the same counts in the step's metadata. Each
offset is at most the tensor's offset at maximum rows, so a step always
fits its slot.

No staging copy on the sender. An earlier version packed the rows into a
local send buffer on the current stream and ran the peer copy on a side
stream, so that the caller's stream was free after the pack. Measured on two
H200s (IPC-opened peer buffers, one process per GPU), any local copy running
on the sending GPU at the same time as a peer copy slows the peer copy by
about 45 %, whether the local copy runs on a copy engine or on the SMs; the
pack cost a quarter of the bandwidth at 64 MiB per step and more than its
own length in latency. So the peer copy reads the caller's tensors directly,
on the caller's current stream (depth 0) or on a relay stream fenced to it
(depth >= 1, below): that stream is held for the transfer (as it is by an
NCCL send on it), and the caller may overwrite its tensors as soon as
``send()`` returns because everything it enqueues later on that stream runs
after the copies.

``depth="auto"`` mixes the two per step: each step goes straight into the
persistent tensors (like depth 0) or through one of D slots (like depth D),
over the same buffer, with one monotone word in ``empty``; ``_auto`` is its
protocol and argues its orderings, ``_copy_engine_auto`` its host side.

Depth 0 keeps no slots. The receiving stage shares its persistent tensors
over CUDA IPC at set-up, and step N goes straight into them::

    sender current:   (pre) wait empty >= N, copy each tensor's rows -> peer persistent, write peer.full = N (post)
    receiver current: ...readers of step N-1..., write sender.empty = N, (pre) wait full >= N (post)

``empty = N`` is written on the receiver's stream when it reaches recv(N),
after everything queued there before, so the copies of step N never
overwrite rows a reader of step N-1 still needs; the receiver's copy out of
a slot is gone (lowest latency when it already waits), and in exchange the
transfer of step N cannot start before the receiver's stream reached
recv(N).

With depth >= 1 the sender's part of a step runs on a relay stream of its
own, fenced to the caller's current stream by an event on each side (after
the caller's earlier work, before its later work)::

    relay:           (pre) [wait empty >= N-D if N > D] (waited) wait ready,
                     copies -> peer slot s, write peer.full = N, (post)
    caller's stream: ...caller's work... (ready) ............................... wait post, ...

The relay waits for the receiver's flag before it waits for the caller's
work, so the flag wait is over (or runs) while the caller's stream is still
busy, and once the caller's work is done only the copies are left. On the
caller's stream itself the flag wait would sit between that work and the
copies. Peer copies issued on the legacy default stream (torch's default)
also cost 5-10 us more each when they run back to back (about 3x the copy
itself at 64 KiB), which the relay avoids.

Depth 0 sends on the caller's stream itself. Its steps wait for the
receiver's stream to reach recv() anyway, so one step's copies never follow
the last step's back to back, and the relay's two event hops would cost
more than they save. (On the legacy default stream a depth-0 step also goes
out one tensor at a time: the driver refuses batched copies there. The
figures below include that.)

Measured on two H200s (``bench/results/2026-11-30-h200x2-probes``), ping-pong
one-way at 8 MiB:
- probe 6, torch's default stream: depth 0 relayed 38.5 us, on the caller's
  stream 35.0 us. Depth 2 on the caller's stream 55.1 us; relayed with the
  caller's work waited for first 48.5 us, with the receiver's flag first
  45.0 us. Its sustained bandwidth at 8 MiB on the caller's stream was 263 GB/s
  against 280 relayed.
- probe 7, each rank on a created stream: depth 2 on the caller's stream
  50.8 us, relayed 45.8 us (64 KiB: 27.2 and 21.2 us). Sustained bandwidth
  within 0.7 % either way from 8 to 256 MiB.

With D >= 1, up to D steps are in flight per link: the sender's stream
waits only when the receiver's stream is D steps behind. While the receiver
copies step N-1 out of its slot, step N lands in the next slot. (Depth 0,
above, is a rendezvous on the GPU: two stages that each send before they
receive on one stream wait for each other until the timeout, as unbatched
NCCL sends do; with D >= 1 they do not.)

Why each ordering is safe:
- The peer copies read the caller's tensors after the work the caller queued
  before ``send()`` on the current stream (the producers; with depth >= 1
  the relay waits for the ``ready`` event recorded there), and before
  anything it queues there afterwards (a later overwrite; with depth >= 1
  the caller's stream waits for the ``post`` event recorded after them).
- Peer slot s is rewritten (step N) only after ``empty >= N-D``: the receiver
  writes ``empty = N-D`` on its stream after its copy of step N-D out of slot
  s, the last read of that slot before step N; a larger value is written
  later still. Steps N-D+1 .. N-1 use the other slots, so they may be in
  flight at the same time.
- The receiver reads slot s only after ``full >= N``: the sender writes
  ``full = N`` on its stream after the copies of step N (and, in stream
  order, of every earlier step); over NVLink the data lands before the flag
  write that follows it (why PCIe peers are refused), and on one GPU it is
  local memory in stream order. Step N+D, the next writer of slot s, cannot
  start before the receiver wrote ``empty = N`` (previous point).
- Steps go out, and slots are freed, in step order whatever stream each
  call runs on, so both flags only grow. With depth >= 1 every step goes out
  on the one relay stream. Otherwise (a depth-0 send, any recv) a call on
  another stream than the previous call first waits for the event recorded
  after the previous step's flag write (``sent`` on the sender, ``received``
  on the receiver).
- The persistent tensors are rewritten on the receiver's current stream
  (depth 0: by the sender's copies, between the receiver's ``empty`` write
  and its ``full`` wait on that stream), after whatever the caller queued
  there before recv() (readers of the last step included), and the caller's
  later work sees the new rows.

A step's tensors go out as one ``cuMemcpyBatchAsync`` where the driver and
cuda-bindings have it (a CUDA 13.0 driver with cuda-bindings 13, 12.8 with
cuda-bindings 12.8+; tried once at set-up, into the next stage's buffer),
which saves every tensor after the first its copy-engine start-up (about
2.4 us on H200s); otherwise, and for a depth-0 step sent from the legacy
default stream (which the driver refuses for batches), one
``cuMemcpyAsync`` each. Inside a batch the
copies run in any order, which is fine: they write disjoint bytes.

Host cost per step: a handful of driver calls, no host sync and no GPU
allocation (unless an input is non-contiguous: see send()). The driver calls are bound once (``_driver.Hot``: results
checked inline, a failure raises the same ``CudaError`` as ``cuda.call``),
and the primary context is pushed only when the calling thread does not
already have it current (``_driver.ThreadBinding``: checked with the driver
once per thread, then with torch's current device). Step validation uses
expectations worked out at set-up (``_layout.StepCheck``). The watchdog's
bracket events come from a pool that only grows while more steps are in
flight than ever before. The receiver's ``empty`` write is one
``cuStreamWriteValue64`` per step; it is what frees a slot, so batching it
would stall the sender.

Metadata (N and the row counts) goes to the next stage over a Unix socket
of the node (``_meta_channel``): a few system calls per step on each side,
and a receiver blocked waiting for it burns no CPU and learns at once when
the sender's process died. The host never waits for the GPU. A watchdog
(``_watchdog.py``) bounds every GPU-side wait; the metadata receive has a host timeout.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from syncless._core.errors import PeerTimeoutError, TransportFailedError
from syncless.pp import _driver as drv
from syncless.pp import _faults, _fork
from syncless.pp._base import Transport, refuse_graph_capture
from syncless.pp._copy_engine_auto import AutoCalls
from syncless.pp._copy_engine_end import CopyEngineEnding, release_dropped, write_release
from syncless.pp._copy_engine_recv import CopyEngineReceiving
from syncless.pp._group import StageMap
from syncless.pp._layout import Ring, StepCheck, dense_spans
from syncless.pp._teardown import Teardown
from syncless.pp._watchdog import Bracket, Watchdog

if TYPE_CHECKING:
    from syncless.pp._copy_engine_setup import Parts

logger = logging.getLogger(__name__)

FULL_OFFSET = 0
EMPTY_OFFSET = 8
SCRATCH_OFFSET = 16  # zeros nobody reads: the trial of batched copies in set-up copies zeros over zeros there
SCRATCH_NBYTES = 32
REGION_OFFSET = 256
assert EMPTY_OFFSET + 8 <= SCRATCH_OFFSET and SCRATCH_OFFSET + SCRATCH_NBYTES <= REGION_OFFSET


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    """Return the handle of torch's current stream on GPU ``index`` (an int; 0 is the legacy default stream)."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


class CopyEngineTransport(CopyEngineReceiving, AutoCalls, CopyEngineEnding, Transport):
    """Pipeline transport over copy engines; built by ``make_transport``. See the module docstring.

    Attributes:
        depth: steps that may be in flight on each link (slots per buffer; 0: none, straight into
            the persistent tensors), or ``"auto"`` (each step direct or through a slot: ``_auto``).
        auto_slots: with ``depth="auto"``, the slots per link (``SYNCLESS_PP_AUTO_SLOTS``); else 0.
        direct_unavailable_reason: with ``depth="auto"``, why steps into this stage, or out of it, can
            never go straight into the receiver's persistent tensors (they are not in memory that may
            be shared: see ``alloc_persistent``), logged once by the receiving stage; None when every
            link of this stage may go direct, and always with a fixed depth.
        batched_copies: whether send() issues a step's tensors as one batched copy (False where this
            stage sends fewer than two tensors, or the driver or cuda-bindings cannot, which the debug
            log says; even when True, a depth-0 step sent from the legacy default stream goes out one
            tensor at a time, since the driver refuses batches there).
    """

    backend = "copy_engine"

    def __init__(
        self,
        *,
        teardown: Teardown,
        parts: Parts,
        side_group: Any,
        stages: StageMap,
        recv_ring: Ring,
        next_ring: Ring | None,
        persistent: dict[str, torch.Tensor],
        device: torch.device,
        timeout_s: float,
        auto: bool = False,
        direct_min_nbytes: int = 0,
    ):
        self.device = device
        self.fallback_reason = None
        self.depth: int | str = "auto" if auto else recv_ring.depth
        self.auto_slots = recv_ring.depth if auto else 0
        problems = [p for p in (parts.direct_problem, parts.next_direct_problem) if p is not None] if auto else []
        self.direct_unavailable_reason = "; ".join(problems) or None
        self._teardown = teardown
        self._drained = False  # close() saw every queued step finish (or gave up on it)
        self._gpu_idle = False
        self._in_call = False  # a send() or recv() is running (abort() then leaves the GPU objects alone)
        self._draining = False  # close() waits for the GPU (abort() then leaves the GPU objects alone too)
        self._parts = parts
        self._ctx = parts.ctx
        self._side_group = side_group
        self._stages = stages
        self._recv_ring = recv_ring
        self._recv_layout = recv_ring.layout
        self._last_send_stream: int | None = None
        self._last_recv_stream: int | None = None
        self._send_layout = next_ring.layout if next_ring is not None else None
        self._persistent = persistent
        self._timeout_s = timeout_s
        self._send_step = 0
        self._recv_step = 0
        self._failure: BaseException | None = None
        self._released = False  # the watchdog released our flags at least once
        self._closed = False
        self._full = parts.buffer + FULL_OFFSET
        self._empty = parts.buffer + EMPTY_OFFSET
        self._region = parts.buffer + REGION_OFFSET
        nxt, prv = stages.index + 1, stages.index - 1
        self._next_full = parts.peer_base[nxt] + FULL_OFFSET if nxt in parts.peer_base else 0
        self._prev_empty = parts.peer_base[prv] + EMPTY_OFFSET if prv in parts.peer_base else 0
        # Slot addresses, computed once: send() and recv() only index these lists.
        self._recv_slots = [self._region + recv_ring.slot_offset(k) for k in range(recv_ring.depth)]
        if next_ring is not None and nxt in parts.peer_base:
            next_region = parts.peer_base[nxt] + REGION_OFFSET
            self._next_slots = [next_region + next_ring.slot_offset(k) for k in range(next_ring.depth)]
        else:
            self._next_slots = []
        # The watchdog holds this transport weakly, so a transport dropped without close() is collected;
        # the finalizer then releases what is safe without a peer (see release_dropped).
        self._watchdog = Watchdog(timeout_s, weakref.WeakMethod(self._on_timeout), parts.recycle_event,
                                  self._ctx.make_current)
        poisoned = recv_ring.nbytes if stages.prev_rank is not None else 0
        self._release = functools.partial(write_release, parts.private_stream, self._region, poisoned, self._full,
                                          self._empty)
        self._finalizer = weakref.finalize(self, release_dropped, teardown, self._watchdog, self._ctx, self._release,
                                           stages.name())
        self._finalizer.atexit = False  # at interpreter exit the process's memory goes anyway
        _fork.forget_in_child(self)
        # Per-step constants, worked out once so send() and recv() do only what changes per step.
        self.batched_copies = parts.batch_problem is None
        self._hot = drv.Hot(batch=self.batched_copies)
        self._binding = drv.thread_binding(self._ctx)
        self._index = device.index
        torch.cuda.current_stream(device)  # torch's CUDA state is initialised before the raw lookups below
        self._recv_row_nbytes = [spec.row_nbytes for spec in self._recv_layout.specs.values()]
        self._recv_targets = [persistent[name].data_ptr() for name in self._recv_layout.specs]
        self._recv_what = f"{stages.name()} receiving step {{}}"
        if self._send_layout is not None:
            self._send_check = StepCheck(self._send_layout.specs, device, stages.name(stages.index + 1))
            self._send_row_nbytes = [spec.row_nbytes for spec in self._send_layout.specs.values()]
            self._send_names = self._send_layout.names
            self._send_what = f"send step {{}} to {stages.name(stages.index + 1)}"
        self._set_up_auto(auto, recv_ring.depth, direct_min_nbytes)

    def _caller_stream(self) -> int:
        """Return the handle of the caller's current stream on this stage's GPU."""
        return _current_stream(self._index)

    # -- sending ---------------------------------------------------------------------

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Send one step to the next stage.

        Enqueues, with ``depth`` >= 1, on a private relay stream fenced to
        the caller's current stream of this stage's GPU by events before and
        after (the same ordering for the caller as if it ran there), and with
        depth 0 on that stream itself: wait until the next stage freed the
        step's slot (only when ``depth`` steps are in flight; with depth 0,
        until the next stage's stream reached ``recv()`` for this step), copy
        each tensor's rows into it (copy engine, no SM; a non-contiguous
        input is first made contiguous by a copy kernel on the current
        stream), and raise the next stage's ``full`` flag. The caller's
        stream is held until the data has crossed, so the caller may
        overwrite ``tensors`` (on that stream) as soon as this returns.
        Blocks the host for none of it, only to write the step's metadata to
        the next stage's socket (it waits there only if that stage's host
        left a few hundred steps unread, at most the timeout). Successive
        sends may run on different streams: each step goes out after the
        previous one. With ``depth="auto"`` each step runs as depth 0 does
        (on the caller's stream, into the persistent tensors) when the next
        stage has posted its ``recv()`` for it, else as depth D does (see
        ``_copy_engine_auto``); the host also reads, without blocking, what
        the next stage posted.

        Raises:
            ValueError, TypeError: the step does not fit the next stage's layout (nothing was enqueued).
            PeerTimeoutError: an earlier step timed out, or the next stage took no metadata within the
                timeout; the transport is unusable.
            RuntimeError: this is the last stage, the transport is closed, or an earlier step failed
                part-way (the transport is unusable).
        """
        if self._closed or self._failure is not None:
            self._check_usable()
        if self._send_layout is None:
            raise RuntimeError(f"{self._stages.name()} is the last stage: it has no next stage to send to")
        refuse_graph_capture(self._stages.name(), "send")
        self._in_call = True
        try:
            self._send(tensors)
        finally:
            self._in_call = False

    def _send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if self._auto_send is not None:
            self._send_auto(tensors)
            return
        rows = self._send_check.rows(tensors)
        step = self._send_step + 1
        depth = self.depth
        spans, _ = dense_spans(self._send_row_nbytes, rows)
        if depth:
            slot = self._next_slots[(step - 1) % depth]
            destinations = [slot + offset for offset, _ in spans]
        else:
            destinations = self._parts.next_targets  # straight into the next stage's persistent tensors
        # `dense` holds the contiguous temporaries until every copy is enqueued; after that, freeing is
        # safe: the caching allocator reuses a block on the current stream only behind work queued there
        # later, which comes after the copies (depth 0: they are on that stream; depth >= 1: it waits for
        # the relay's `post`).
        dense, copies = self._step_copies(tensors, destinations, spans)
        parts, hot = self._parts, self._hot
        # Depth >= 1 runs the step on the relay stream, fenced on both sides to the caller's stream: after
        # what the caller queued before send(), before what it queues afterwards. Depth 0 runs it on the
        # caller's stream (see the module docstring for both).
        relayed = depth > 0
        pushed = self._binding.enter()
        current = _current_stream(self._index)
        stream = parts.relay_stream if relayed else current
        enqueued = False
        try:
            # Every event first, so that no failure comes between the first enqueued wait and the last.
            pre, post = parts.acquire_event(), parts.acquire_event()
            # Relayed: `ready` (the caller's work before send() is done) starts the watchdog's clock
            # together with `pre`, and `waited` (the flag wait is over) stops it: the clock runs only
            # while the relay waits for the receiver with the caller's work done.
            ready, waited = (parts.acquire_event(), parts.acquire_event()) if relayed else (None, None)
            if not relayed and self._last_send_stream not in (None, stream):
                # Steps go out in order whatever stream each send() runs on: this step's copies and
                # its `full` write come after the previous step's `full` write, so `full` only grows.
                # (Relayed steps all run on the one relay stream, in order.)
                hot.wait_event(parts.sent, stream)
            hot.record(pre, stream)
            enqueued = True
            if step > depth:
                # The receiver is done with step N-D (depth 0: its stream reached recv(N)).
                hot.wait_geq(stream, self._empty, step - depth)
            if relayed:
                # The receiver's flag first, the caller's work second: the flag wait runs while the
                # caller's stream is still busy. Both waits come before the copies, in either order.
                hot.record(waited, stream)
                hot.record(ready, current)
                hot.wait_event(ready, stream)
            # One batched copy-engine operation for all tensors where the driver offers it (not on
            # the legacy default stream, which the driver refuses for batches: depth 0 there copies
            # one tensor at a time).
            hot.memcpy_all(copies, stream)
            hot.write(stream, self._next_full, step)
            if not relayed:
                hot.record(parts.sent, stream)
            hot.record(post, stream)
            if relayed:
                # The caller's later work waits for the whole step; `post` was just recorded there.
                hot.wait_event(post, current)
        except BaseException as err:
            self._fail_mid_step(f"sending step {step}", err)
            if enqueued:
                self._watch_after_failure(stream, pre, post, step, current if relayed else None)
            raise
        finally:
            self._binding.exit(pushed)
        self._last_send_stream = stream
        self._send_metadata(step, rows, Bracket(stream, pre, post, self._send_what, step, waited=waited, ready=ready))

    def _send_metadata(self, step: int, fields: list[int], bracket: Bracket) -> None:
        """Watch the enqueued step ``step`` and send its metadata (``fields`` after the step number)."""
        try:
            # From here the GPU part of the step is enqueued: anything that stops the metadata (the peer,
            # an interrupt, an error) leaves the flags ahead of the steps, so it poisons the transport.
            self._watchdog.watch(bracket)
            if _faults.hook is not None:
                _faults.hook("step:before_meta")
            self._parts.meta_out.send(step, fields)
        except BaseException as err:
            failure: BaseException
            if isinstance(err, PeerTimeoutError):
                failure = PeerTimeoutError(
                    f"{self._stages.name()} sending step {step}: its metadata did not go out ({err}); "
                    "this transport is unusable: close() or abort() it"
                )
            else:
                failure = TransportFailedError(
                    f"{self._stages.name()} sending step {step}: stopped after its data was enqueued and before "
                    f"its metadata went out ({err!r}); this transport is unusable: close() or abort() it"
                )
            if self._failure is None:  # an abort() on another thread may have come first: it stays the error
                self._failure = failure
            raise failure from err
        self._send_step = step
        if _faults.hook is not None:
            _faults.hook("step:after_meta")

    def _step_copies(self, tensors: Mapping[str, torch.Tensor], destinations: Any,
                     spans: Any) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """``(dense, copies)`` of one step: ``(destination, source, nbytes)`` per tensor with bytes, in layout order.

        A non-contiguous input, or a conjugate or negative view (whose bytes are not its values: torch
        applies the flag lazily, and ``contiguous()`` returns such a view itself), becomes a temporary
        with its values in memory (a copy kernel on the current stream), kept in ``dense`` until the
        caller has enqueued the copies.
        """
        dense: list[torch.Tensor] = []
        copies: list[tuple[int, int, int]] = []
        for name, destination, (_, nbytes) in zip(self._send_names, destinations, spans):
            if nbytes:
                tensor = tensors[name]
                if tensor.is_conj() or tensor.is_neg():
                    tensor = tensor.resolve_conj().resolve_neg()
                tensor = tensor.contiguous()
                dense.append(tensor)
                copies.append((destination, tensor.data_ptr(), nbytes))
        return dense, copies

    def _watch_after_failure(self, stream: int, pre: Any, post: Any, step: int, caller: int | None) -> None:
        """Best effort after a step failed with part of it enqueued on ``stream``: watch it, fence the caller.

        A flag wait may already be on ``stream`` behind ``pre``: with ``post``
        recorded after it, the watchdog releases it after the timeout if the
        peer never comes, so neither the stream nor ``close()`` waits forever.
        The clock runs from ``pre``, which may count the caller's own work
        too: the transport is unusable anyway. When the step was relayed,
        ``caller`` (the caller's stream) also waits for ``post``, so
        contiguous temporaries freed there are not reused while a copy
        enqueued on the relay may still read them. (Nothing enqueued, nothing
        to fence: earlier steps are fenced by their own ``post``.)
        """
        with contextlib.suppress(Exception):
            self._hot.record(post, stream)
            self._watchdog.watch(Bracket(stream, pre, post, self._send_what, step))
            if caller is not None:
                self._hot.wait_event(post, caller)

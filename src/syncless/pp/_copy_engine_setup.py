"""Setting up the copy-engine transport: four collective steps, every rank failing alike.

1. What each rank can tell alone: CUDA, 64-bit stream memory operations,
   more than one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS``).
2. Topology (one node, NVLink between every pair of stage GPUs), then each
   rank allocates and zeroes its buffer (``_copy_engine`` describes its
   layout) and shares the IPC handle, with the name and token of the socket
   the previous stage will send metadata to (and, at depth 0 and with
   ``depth="auto"`` where they may be shared, handles of its persistent
   tensors; with ``"auto"``, why not where they may not).
3. Each rank maps its neighbours' buffers (and, at depth 0 or "auto", the next
   stage's persistent tensors, checking the offsets that stage sent against
   what it mapped: :func:`check_targets`), tries a batched copy into the
   next stage's scratch bytes, and connects to the next stage's socket.
4. Each rank accepts the previous stage's connection.

Each step runs through :func:`~syncless.pp._group.agree`: any rank's failure
makes every rank raise the same exception (:class:`CopyEngineUnavailable`
when copy engines cannot be used, which ``make_transport`` may fall back
from; any other error as itself, naming the stage), after every rank has
unmapped and freed what it made (or, where a peer may still map it because
the tear-down barrier failed, leaked it by design: ``_teardown``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from syncless._core import cuda as cuda_core
from syncless._core.errors import CopyEngineUnavailable, CudaError, PeerTimeoutError, TransportSetupError
from syncless._core.logs import log_once
from syncless.pp import _driver as drv
from syncless.pp import _faults
from syncless.pp import _meta_channel as meta_channel
from syncless.pp import _persistent as persistent_memory
from syncless.pp import _wire as wire
from syncless.pp._auto import MAX_SLOTS, MIN_SLOTS
from syncless.pp._copy_engine import REGION_OFFSET, SCRATCH_NBYTES, SCRATCH_OFFSET, CopyEngineTransport
from syncless.pp._eligibility import (
    StageDevice,
    connections_problem,
    local_stage_device,
    mem_ops_problem,
    query_nvlink,
    topology_problem,
)
from syncless.pp._group import StageMap, agree, barrier
from syncless.pp._layout import AUTO_DEPTH, Layout, Ring, TensorSpec
from syncless.pp._teardown import Teardown, keep_forever

logger = logging.getLogger(__name__)

INJECTABLE_FAILURES = ("mem_ops", "peer_open")
#: The longest reason a stage gives for not sharing its persistent tensors with depth="auto".
MAX_REASON_CHARS = 4096


def open_copy_engine(
    *,
    side_group: Any,
    stages: StageMap,
    specs: list[dict[str, TensorSpec]],
    persistent: Mapping[str, torch.Tensor],
    device: torch.device,
    timeout_s: float,
    depth: int | str,
    auto_slots: int = 0,
    auto_direct_min_nbytes: int = 0,
    inject_failure: str | None,
) -> CopyEngineTransport:
    """Set up the copy-engine transport; collective over the stages.

    Every stage passes the same ``depth`` (``make_transport`` checked it):
    each stage's receive buffer holds ``depth`` slots (``auto_slots`` with
    ``depth="auto"``, which also shares the persistent tensors where
    ``_share_persistent`` allows it, and otherwise runs every step through a
    slot: no error). Blocks the host
    for four exchanges over the CPU group, and twice for a private stream
    (zeroing the buffer; the trial of batched copies). Enqueues nothing on
    the caller's streams. Any failure on any rank raises the same exception
    on every rank, after every rank has unmapped and freed what it made.

    Raises:
        CopyEngineUnavailable: some stage cannot use copy engines (the message names the first).
        PeerTimeoutError: a set-up exchange timed out.
        RuntimeError, ValueError, TypeError: another failure on some stage, raised alike everywhere.
    """
    what = f"{stages.name()} copy-engine set-up"
    stack = Teardown()
    outcome = _Outcome()
    try:
        # Step 1: what each rank can tell alone (CUDA, memory ops, hardware queues).
        def local_checks() -> StageDevice:
            _faults.reach("setup:check")
            if inject_failure == "mem_ops":
                raise CopyEngineUnavailable("64-bit stream memory operations refused (injected failure for tests)")
            if device.type != "cuda":
                raise CopyEngineUnavailable(f"this stage's tensors are on {device}, not a CUDA GPU")
            problem = mem_ops_problem(device.index) or connections_problem()
            if problem:
                raise CopyEngineUnavailable(problem)
            return local_stage_device(device.index)

        devices = outcome.agree(side_group, stages, local_checks)

        ctx = drv.PrimaryContext(device.index)
        # Dropped last, and only if nothing was leaked (the retain keeps a leaked buffer's context alive).
        stack.shared(ctx.release, nbytes=0, what="the primary-context retain")
        parts = Parts(ctx)
        auto = depth == AUTO_DEPTH
        slots = auto_slots if auto else depth
        if auto and not MIN_SLOTS <= slots <= MAX_SLOTS:
            raise ValueError(f'depth="auto" keeps {MIN_SLOTS} to {MAX_SLOTS} slots per link; got {slots}')
        recv_ring = Ring(Layout.from_specs(specs[stages.index]), slots)
        next_ring = Ring(Layout.from_specs(specs[stages.index + 1]), slots) if stages.next_rank is not None else None
        meta_length = 1 + (1 if auto else 0)  # the step, the path bit (auto only), then one row count per tensor

        # Step 2: topology (every pair of GPUs on NVLink), then allocate and export (with the name of
        # the socket the previous stage will send metadata to).
        # From here peers may map our buffer: nobody frees before every stage unmapped. Registered on
        # every rank before step 2 (even one whose step fails before it allocates), so that every rank
        # unwinding a failed set-up enters the barrier alike.
        stack.barrier(barrier, side_group, timeout_s, "copy-engine tear-down")

        def local_allocate() -> _Export:
            _faults.reach("setup:allocate")
            try:
                problem = topology_problem(devices, query_nvlink)
            except cuda_core.nvml_errors() as err:
                raise CopyEngineUnavailable(
                    f"NVML could not tell whether the GPUs are NVLink-connected: {err}"
                ) from err
            if problem:
                raise CopyEngineUnavailable(problem)
            with ctx:
                parts.private_stream = drv.stream_create(highest_priority=True)  # the watchdog's releases
                stack.local(_in(ctx, drv.stream_destroy), parts.private_stream)
                relays = next_ring is not None and next_ring.depth > 0  # depth >= 1 and auto send through a relay
                if relays:
                    parts.relay_stream = drv.stream_create()
                    stack.local(_in(ctx, drv.stream_destroy), parts.relay_stream)
                stack.local(_in(ctx, parts.destroy_events))
                if next_ring is not None and (auto or not relays):  # auto: its direct steps leave the relay
                    parts.sent = parts.acquire_event()
                if stages.prev_rank is not None:
                    parts.received = parts.acquire_event()
                # Whole pages: the driver may put small allocations side by side in one page, and a peer maps
                # what IPC shares by the page, so a page of its own keeps this process's other memory out
                # of the neighbours' reach (as alloc_persistent does for depth 0).
                buffer_nbytes = persistent_memory.whole_pages(REGION_OFFSET + recv_ring.nbytes)
                parts.buffer = drv.mem_alloc(buffer_nbytes)
                stack.shared(_in(ctx, drv.mem_free), parts.buffer, nbytes=buffer_nbytes,
                             what=f"{stages.name()}'s receive buffer")
                drv.mem_zero(parts.buffer, buffer_nbytes, parts.private_stream)
                # The flags must read 0 before any peer can see the handle.
                drv.stream_synchronize(parts.private_stream)
                handle = drv.ipc_handle(parts.buffer)
            if stages.prev_rank is None:
                return _Export(handle)
            targets: list[tuple[int, int]] = []
            target_handles: list[bytes] = []
            if depth == 0:
                targets, target_handles = _share_persistent(ctx, persistent, recv_ring.layout)
            elif auto:
                try:
                    targets, target_handles = _share_persistent(ctx, persistent, recv_ring.layout, 'depth="auto"')
                except CopyEngineUnavailable as err:  # no error here: every step into this stage takes a slot
                    reason = f"steps into {stages.name()} all go through a slot: {err}"
                    # Bounded, as the set-up message that carries it to the previous stage must be.
                    parts.direct_problem = reason if len(reason) <= MAX_REASON_CHARS else \
                        reason[:MAX_REASON_CHARS - 3] + "..."
                    log_once(logger, logging.WARNING, f"pp-auto-direct:{parts.direct_problem}",
                             "syncless.pp: %s", parts.direct_problem)
            if depth == 0 or (auto and parts.direct_problem is None):
                exposed = dict(persistent)
                storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in exposed.values()}
                stack.shared(_nothing, nbytes=sum(storages.values()),  # each shared allocation counted once
                             what=f"{stages.name()}'s persistent tensors (mapped by the previous stage "
                                  f"{'at depth 0' if depth == 0 else 'for direct steps'})",
                             on_leak=lambda: keep_forever(exposed))
            try:
                parts.listener = meta_channel.Listener()
            except OSError as err:
                raise CopyEngineUnavailable(f"could not create a local socket for the step metadata: {err}") from err
            stack.local(parts.listener.close)
            return _Export(handle, parts.listener.name, parts.listener.token, targets, target_handles,
                           parts.direct_problem)

        exported: list[_Export] = outcome.agree(side_group, stages, local_allocate)
        handles = [export.buffer_handle for export in exported]

        # Step 3: map the neighbours' buffers.
        def local_open() -> None:
            _faults.reach("setup:open")
            if inject_failure == "peer_open":
                raise CopyEngineUnavailable("opening the peer's CUDA IPC handle failed (injected failure for tests)")
            with ctx:
                for neighbour in (stages.index - 1, stages.index + 1):
                    if 0 <= neighbour < len(stages.ranks):
                        base = drv.ipc_open(handles[neighbour])
                        stack.unmap(_in(ctx, drv.ipc_close), base, what=f"{stages.name(neighbour)}'s buffer")
                        parts.peer_base[neighbour] = base
                        # This stage writes the previous one's `empty` flag, and the next one's flags and slots.
                        needed = REGION_OFFSET + (next_ring.nbytes if neighbour > stages.index else 0)
                        check_buffer(_mapped_size(base, f"{stages.name(neighbour)}'s buffer"), needed,
                                     stages.name(neighbour))
                if _sends_several_tensors(next_ring):
                    # Try a batch on the path send() takes, into the next stage's mapped buffer: the first
                    # half of our scratch (zeros) over the second half of its scratch (zeros nobody reads).
                    parts.batch_problem = drv.batch_copy_problem(
                        parts.buffer + SCRATCH_OFFSET,
                        parts.peer_base[stages.index + 1] + SCRATCH_OFFSET + SCRATCH_NBYTES // 2,
                        parts.private_stream,
                    )
                    if parts.batch_problem is not None:
                        logger.debug("%s sends one copy per tensor: %s", stages.name(), parts.batch_problem)
                if next_ring is not None and auto:
                    parts.next_direct_problem = exported[stages.index + 1].direct_problem
                if next_ring is not None and (not depth or (auto and parts.next_direct_problem is None)):
                    nxt = exported[stages.index + 1]
                    bases, sizes = [], []
                    for target_handle in nxt.target_handles:
                        bases.append(drv.ipc_open(target_handle))
                        stack.unmap(_in(ctx, drv.ipc_close), bases[-1], what="the next stage's persistent tensors")
                        sizes.append(_mapped_size(bases[-1], "the next stage's persistent tensors"))
                    # The pairs come from another process: check them before any copy is aimed with them.
                    check_targets(nxt.targets, sizes, next_ring.layout, stages.name(stages.index + 1))
                    parts.next_targets = [bases[which] + offset if which >= 0 else 0 for which, offset in nxt.targets]
            if next_ring is not None:
                nxt = exported[stages.index + 1]
                try:
                    parts.meta_out = meta_channel.connect(
                        nxt.socket_name, nxt.token, meta_length + len(next_ring.layout.specs), timeout_s, what
                    )
                except PeerTimeoutError as err:
                    raise CopyEngineUnavailable(str(err)) from err
                stack.local(parts.meta_out.close)

        outcome.agree(side_group, stages, local_open)

        # Step 4: take the previous stage's metadata connection (made in step 3, so it is waiting).
        def local_accept() -> None:
            _faults.reach("setup:accept")
            if parts.listener is None:
                return
            try:
                parts.meta_in = parts.listener.accept(meta_length + len(recv_ring.layout.specs), timeout_s, what)
            except PeerTimeoutError as err:
                raise CopyEngineUnavailable(str(err)) from err
            stack.local(parts.meta_in.close)
            parts.listener.close()  # nobody else may connect later (closing twice is harmless)

        outcome.agree(side_group, stages, local_accept)
    except BaseException as err:
        _unwind(stack, what, err, collective=outcome.uniform)
        raise
    try:
        return CopyEngineTransport(
            teardown=stack,
            parts=parts,
            side_group=side_group,
            stages=stages,
            recv_ring=recv_ring,
            next_ring=next_ring,
            persistent=dict(persistent),
            device=device,
            timeout_s=timeout_s,
            auto=auto,
            direct_min_nbytes=auto_direct_min_nbytes,
        )
    except BaseException as err:
        _unwind(stack, what, err, collective=False)  # nothing stays allocated or mapped, unless a peer may map it
        raise


class _Outcome:
    """Runs the set-up exchanges and remembers whether the last failure was the same on every stage."""

    def __init__(self) -> None:
        self.uniform = False

    def agree(self, side_group: Any, stages: StageMap, local: Any) -> Any:
        """``agree`` one set-up step; on failure note whether every stage raises the same error.

        ``agree`` raises either the failure every stage shares (after a complete exchange: every
        stage unwinds and enters the tear-down barrier alike), or ``PeerTimeoutError`` when the
        exchange itself broke, or an interrupt before it: then the stages' collectives no longer
        line up, and a barrier could pair with a peer's other collective.
        """
        try:
            return agree(side_group, stages, "copy-engine set-up", local)
        except PeerTimeoutError:
            raise
        except Exception:
            self.uniform = True
            raise


def _unwind(stack: Teardown, what: str, err: BaseException, *, collective: bool) -> None:
    """Release what a failed set-up made; leak by design what a peer may map unless ``collective``.

    ``collective``: every stage failed alike and unwinds alike, so the barrier in ``stack`` pairs up.
    Otherwise (a broken exchange, an interrupt, a local error between exchanges) no barrier is
    entered and this stage's buffer is kept (``_teardown``). Set-up waited for its private stream
    each time it used it, so this GPU is idle. A failure while releasing is logged, never raised
    over ``err``.
    """
    try:
        stack.run(collective=collective, gpu_idle=True)
    except Exception as release_err:  # noqa: BLE001 - logged; the set-up error is the one raised
        logger.warning("%s failed (%s); releasing what it made also failed: %s", what, err, release_err)
    if stack.leaked:
        logger.warning("%s failed; kept by design (a peer may still map them): %s", what, "; ".join(stack.leaked))
        try:  # what the caller's error reports, an interrupt's too (docs/failure-model.md)
            err.leaked_nbytes = stack.leaked_nbytes
        except (AttributeError, TypeError):  # an exception type that takes no attributes: the log above says it
            pass


def _nothing() -> None:
    """The release of tensors the caller owns: nothing to do here, the caller frees them."""


def _sends_several_tensors(next_ring: Ring | None) -> bool:
    """Whether this stage sends steps of two or more tensors (only those can gain from a batched copy)."""
    return next_ring is not None and len(next_ring.layout.specs) > 1


class _Export(NamedTuple):
    """What a stage shares with the others in set-up step 2."""

    buffer_handle: bytes  # IPC handle of its flags + receive slots
    socket_name: str | None = None  # where the previous stage sends metadata (None on the first stage)
    token: bytes | None = None  # what that connection must present first
    targets: Sequence[tuple[int, int]] = ()  # depth 0, auto: (handle index, offset) per persistent tensor
    target_handles: Sequence[bytes] = ()  # depth 0, auto: one IPC handle per allocation holding persistent tensors
    direct_problem: str | None = None  # auto: why its persistent tensors are not shared (None: they are)


# What may come back from a peer in step 2, checked field by field (set-up messages carry no pickles).
wire.register_record(
    _Export,
    buffer_handle=(wire.is_bytes_of(drv.IPC_HANDLE_NBYTES), f"{drv.IPC_HANDLE_NBYTES} bytes (a CUDA IPC handle)"),
    socket_name=(wire.is_optional(meta_channel.is_listener_name), "None or the abstract name of a syncless listener"),
    token=(wire.is_optional(wire.is_bytes_of(meta_channel.TOKEN_NBYTES)), f"None or {meta_channel.TOKEN_NBYTES} bytes"),
    targets=(wire.is_sequence_of(wire.is_tuple_of(wire.is_int_at_least(-1), wire.is_int_at_least(0))),
             "a list of (handle index, byte offset) pairs"),
    target_handles=(wire.is_sequence_of(wire.is_bytes_of(drv.IPC_HANDLE_NBYTES)), "a list of CUDA IPC handles"),
    direct_problem=(wire.is_optional(lambda text: wire.is_str(text) and len(text) <= MAX_REASON_CHARS),
                    f"None or a reason of at most {MAX_REASON_CHARS} characters"),
)


def _share_persistent(
    ctx: drv.PrimaryContext, persistent: Mapping[str, torch.Tensor], layout: Layout, mode: str = "depth=0"
) -> tuple[list[tuple[int, int]], list[bytes]]:
    """Depth 0 and auto: export the persistent tensors so the previous stage can copy straight into them.

    Returns, per tensor in layout order, ``(index into the handle list, byte
    offset in that allocation)`` (``(-1, 0)`` for a tensor of no bytes), and
    one legacy IPC handle per distinct allocation (tensors that share one
    allocation share its handle, so the sender maps each allocation once).

    The previous stage maps each allocation whole, so every allocation must
    hold nothing but persistent tensors (``_persistent.exposure_problem``:
    one from ``alloc_persistent`` whose tensors are all persistent here, or
    one the persistent tensors cover entirely); otherwise no handle is made.

    Raises:
        CopyEngineUnavailable: an allocation would expose other memory to the previous stage, or
            cannot be shared over CUDA IPC.
    """
    targets: list[tuple[int, int]] = []
    allocations: dict[int, tuple[int, list[persistent_memory.Span]]] = {}
    order: list[int] = []  # allocation bases in the order the handles go out
    with ctx:
        for name in layout.specs:
            tensor = persistent[name]
            if tensor.numel() == 0:
                targets.append((-1, 0))
                continue
            start = tensor.data_ptr()
            try:
                base, size = drv.allocation_of(start)
            except CudaError as err:
                raise CopyEngineUnavailable(
                    f"{mode} copies straight into the persistent tensors, but persistent[{name!r}] is not in "
                    f"device memory the driver can place ({err}); allocate the persistent tensors with "
                    "syncless.pp.alloc_persistent(...) or use depth >= 1"
                ) from err
            if base not in allocations:
                allocations[base] = (size, [])
                order.append(base)
            end = start + tensor.numel() * tensor.element_size()  # contiguous (make_transport checked)
            allocations[base][1].append(persistent_memory.Span(name, start, end))
            targets.append((order.index(base), start - base))
        problem = persistent_memory.exposure_problem(allocations, mode=mode)
        if problem:
            raise CopyEngineUnavailable(problem)
        handles = []
        for base in order:
            try:
                handles.append(drv.ipc_handle(base))
            except CudaError as err:
                names = ", ".join(repr(span.name) for span in allocations[base][1])
                raise CopyEngineUnavailable(
                    f"{mode} copies straight into the persistent tensors, but persistent[{names}] is in memory "
                    f"legacy CUDA IPC cannot share ({err}: torch's expandable_segments, cudaMallocAsync or a custom "
                    "pool); allocate the persistent tensors with syncless.pp.alloc_persistent(...) (always "
                    "shareable) or use depth >= 1"
                ) from err
    return targets, handles


def _mapped_size(base: int, what: str) -> int:
    """Return how many bytes of the peer allocation this process mapped at ``base`` lie from ``base`` on.

    From this process's driver (the range of the mapping that holds ``base``), never from the peer, so a
    peer cannot make this stage's copies land past the end of what it shared. (Where the driver places a
    small allocation inside a larger mapped range, the range may start before ``base``.)
    """
    try:
        start, nbytes = drv.allocation_of(base)
    except CudaError as err:
        raise CopyEngineUnavailable(
            f"the driver could not tell the size of {what} as mapped here ({err}); without it this stage "
            "cannot check where its copies land"
        ) from err
    if not start <= base < start + nbytes:
        raise CopyEngineUnavailable(
            f"the driver places {what} at {start:#x}..{start + nbytes:#x}, which does not hold the address it "
            f"was mapped at ({base:#x})"
        )
    return start + nbytes - base


def check_buffer(mapped_nbytes: int, needed_nbytes: int, who: str) -> None:
    """Check that a neighbour's mapped buffer holds what this stage writes into it (its layout, agreed in set-up).

    Raises:
        TransportSetupError: it is smaller (a bug, or a hostile peer that allocated less than its layout).
    """
    if mapped_nbytes < needed_nbytes:
        raise TransportSetupError(
            f"{who}'s buffer has {mapped_nbytes} bytes, but its layout needs {needed_nbytes}; refusing to copy "
            "past its end"
        )


def check_targets(targets: Sequence[tuple[int, int]], sizes: Sequence[int], layout: Layout, who: str) -> None:
    """Check the next stage's depth-0 ``(handle index, byte offset)`` pairs against what this stage mapped.

    The next stage sends them in set-up step 2; this stage's copy engine then writes each step's rows at
    ``mapping[index] + offset``. A pair out of bounds (a bug, or a hostile peer) would aim those writes
    past the mapping, into unrelated memory of this process. Each tensor's largest step (``max_rows``
    rows) must fit in its mapped allocation; ``(-1, 0)`` is allowed only for a tensor of no bytes.

    Args:
        targets: one pair per tensor of ``layout``, in layout order.
        sizes: bytes of each mapped allocation, in handle order.
        layout: the next stage's layout (what this stage sends).
        who: the next stage, for the message.

    Raises:
        TransportSetupError: a pair is out of bounds, or their number does not match the layout.
    """
    if len(targets) != len(layout.specs):
        raise TransportSetupError(
            f"{who} shared {len(targets)} depth-0 target(s) for its {len(layout.specs)} persistent tensors "
            f"({', '.join(layout.specs)}); refusing to copy into its memory"
        )
    for (name, spec), (which, offset) in zip(layout.specs.items(), targets):
        nbytes = spec.nbytes
        if which == -1 and offset == 0 and nbytes == 0:
            continue
        if not 0 <= which < len(sizes):
            raise TransportSetupError(
                f"{who} placed persistent[{name!r}] in allocation {which}, but it shared {len(sizes)} "
                "allocation handle(s); refusing to copy into its memory"
            )
        if offset < 0 or offset + nbytes > sizes[which]:
            raise TransportSetupError(
                f"{who} placed persistent[{name!r}] ({nbytes} bytes at most) at byte {offset} of allocation "
                f"{which}, which has {sizes[which]} bytes; refusing to copy past its end"
            )


def _in(ctx: drv.PrimaryContext, fn: Any) -> Any:
    def run(*args: Any) -> None:
        with ctx:
            fn(*args)

    return run


class Parts:
    """What set-up made, handed to the transport."""

    def __init__(self, ctx: drv.PrimaryContext):
        self.ctx = ctx
        self.private_stream = 0
        self.relay_stream = 0  # where a sender with depth >= 1 runs its steps (see send())
        self.sent: drv.Event | None = None  # depth 0: recorded after each step's `full` write
        self.received: drv.Event | None = None  # recorded after each step's `empty` write
        #: why send() issues one copy per tensor instead of one batch (None: it batches)
        self.batch_problem: str | None = "this stage sends fewer than two tensors per step"
        self.buffer = 0
        self.peer_base: dict[int, int] = {}
        self.next_targets: list[int] = []  # depth 0, auto: the next stage's persistent tensors, mapped here
        self.direct_problem: str | None = None  # auto: why the previous stage cannot copy into ours
        self.next_direct_problem: str | None = None  # auto: why this stage cannot copy into the next stage's
        self.listener: meta_channel.Listener | None = None
        self.meta_in: meta_channel.Receiver | None = None  # from the previous stage
        self.meta_out: meta_channel.Sender | None = None  # to the next stage
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

"""The torch.distributed transport: the same interface over ``isend``/``irecv`` on any backend.

Metadata (step and row counts) goes first over the CPU group with a host
timeout; the data follows on the pipeline group itself for NCCL (CUDA
tensors), and over the private CPU group for gloo, so that a gloo timeout
never breaks the caller's group. Over a gloo-only group, CUDA tensors are
staged through host memory (the host then waits for each copy): a last resort
that keeps NCCL-less set-ups working, not a fast path.

Ordering: the sender clones each tensor's rows on its current stream before
handing them to the backend, so the caller may overwrite its tensors as soon
as send() returns; the clones stay referenced until their sends complete.
The step's metadata is posted only once its clones exist (an allocation
failure or an interrupt in a clone sends nothing, and the step number is not
used), and the data sends follow at once; anything that stops a step after
its metadata was posted poisons the transport (every later call raises). For
NCCL the receiver's current stream is made to wait for the receive
(``work.wait()`` without a timeout does not block the host); for gloo the
host waits, bounded by the timeout. An NCCL receive whose peer died after its
metadata arrived is bounded only by NCCL's own watchdog (the process group's
timeout), not by ``timeout_s``.

``make_transport``'s ``depth`` does not reach this transport: the backend
queues any number of posted sends itself, and every send owns its clones.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from syncless._core.errors import PeerTimeoutError, TransportClosedError, TransportFailedError
from syncless.pp import _faults
from syncless.pp._base import Transport, check_wait, refuse_graph_capture
from syncless.pp._copy_engine_auto import record_send_link
from syncless.pp._group import StageMap, break_side_group, peer_error_text, recv_meta
from syncless.pp._layout import ABSENT, StepCheck, TensorSpec, received_views, rows_are_valid
from syncless.pp._received import ReceivedStep

logger = logging.getLogger(__name__)

#: Steps whose sends may still be in flight before send() waits for the oldest.
MAX_SENDS_IN_FLIGHT = 8


def backend_for(group: Any, device_type: str) -> str:
    """Return the name of the backend ``group`` uses for ``device_type`` tensors (e.g. ``"nccl"``)."""
    import torch.distributed as dist

    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    for piece in name.split(","):
        kind, _, backend = piece.partition(":")
        if kind.strip() == device_type:
            return backend.strip()
    return name


def _on_stream(device: torch.device, handle: int | None) -> Any:
    """Make the stream with raw handle ``handle`` current for a block (None: leave the current one)."""
    if handle is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device))


class TorchDistTransport(Transport):
    """Pipeline transport over torch.distributed point-to-point ops; built by ``make_transport``."""

    backend = "torch_distributed"
    _deferred: ReceivedStep | None = None  # a step recv(wait=False) returned whose wait is not done yet
    _host_waiting = False  # a recv() (or a step's first use) waits in gloo: abort() and close() break that wait

    def __init__(
        self,
        *,
        group: Any,
        side_group: Any,
        stages: StageMap,
        tag: int,
        recv_specs: dict[str, TensorSpec],
        send_specs: dict[str, TensorSpec] | None,
        persistent: Mapping[str, torch.Tensor],
        device: torch.device,
        timeout_s: float,
        fallback_reason: str | None,
        setup_leaked_nbytes: int = 0,
        depth: int | str = 2,
        next_pid: int | None = None,
    ):
        self.device = device
        self.depth = depth  # agreed by every stage and kept for the caller; the backend queues the sends itself
        self.fallback_reason = fallback_reason
        self._setup_leaked_nbytes = setup_leaked_nbytes
        self._group = group
        self._side_group = side_group
        self._stages = stages
        self._meta_tag = tag
        self._data_tag = tag + 1
        self._recv_specs = recv_specs
        self._send_specs = send_specs
        self._send_check = (
            StepCheck(send_specs, device, stages.name(stages.index + 1)) if send_specs is not None else None
        )
        self._persistent = dict(persistent)
        self._timeout_s = timeout_s
        self._send_step = 0
        self._recv_step = 0
        self._pending: deque[tuple[list[Any], list[torch.Tensor]]] = deque()
        self._failure: BaseException | None = None
        self._closed = False
        data_backend = "gloo" if device.type == "cpu" else backend_for(group, device.type)
        self._host_waits = data_backend == "gloo"
        self._stage_via_host = device.type == "cuda" and data_backend == "gloo"
        # gloo traffic goes over the private CPU group: a gloo timeout closes the
        # connection, and that must never break the caller's own group.
        if data_backend == "gloo":
            self._group = side_group
        # batch_isend_irecv must be the group's first P2P call on every rank when it is
        # the group's first collective; with exactly two ranks every rank takes part.
        self._batch = len(stages.ranks) == 2
        # CUDA receivers: the end of the last received step, for readers on other streams (_order_reader).
        self._received = torch.cuda.Event() if device.type == "cuda" and stages.prev_rank is not None else None
        # A depth="auto" copy-engine link of this process that receives from the next stage's process must
        # know about this link back to it (_copy_engine_auto: a cycle through a slot wait).
        self._forget_links = record_send_link(self, next_pid if send_specs is not None else None)

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Send one step to the next stage.

        Clones the rows on the caller's current stream (staging them to host
        memory over a gloo-only group, which blocks the host), then posts the
        sends; NCCL runs them on its own stream after the clones. The caller
        may overwrite ``tensors`` as soon as this returns. With
        ``MAX_SENDS_IN_FLIGHT`` steps still pending, the host first waits for
        the oldest one (its metadata send, and with gloo its data), at most
        the timeout.

        Raises:
            ValueError, TypeError: the step does not fit the next stage's layout (nothing was sent).
            PeerTimeoutError: the oldest pending step did not go out within the timeout.
            RuntimeError: this is the last stage, or the transport is closed or failed.
        """
        import torch.distributed as dist

        self._check_usable()
        if self._send_specs is None:
            raise RuntimeError(f"{self._stages.name()} is the last stage: it has no next stage to send to")
        if self.device.type == "cuda":
            refuse_graph_capture(self._stages.name(), "send")
        rows = self._send_check.rows(tensors)  # in layout order
        self._reap()
        step = self._send_step + 1
        # The data first: an out-of-memory error or an interrupt here sends nothing and uses no step number.
        payloads = []
        for name, count in zip(self._send_specs, rows):
            if count > 0:  # not 0 rows nor a key left out of the step (ABSENT)
                source = tensors[name]
                if self._stage_via_host:
                    payloads.append(source.to("cpu", copy=True).contiguous())
                else:
                    payloads.append(source.clone(memory_format=torch.contiguous_format))
        meta = torch.tensor([step, *rows], dtype=torch.int64)
        works: list[Any] = []
        try:
            if _faults.hook is not None:
                _faults.hook("step:before_meta")
            works.append(dist.isend(meta, dst=self._stages.next_rank, group=self._side_group, tag=self._meta_tag))
            works.extend(self._post(dist.isend, payloads, self._stages.next_rank))
        except BaseException as err:
            # Part of the step may be posted (its metadata without its data): the peers' views of the step
            # numbers may differ from here on, so nothing more may go out.
            failure = TransportFailedError(
                f"{self._stages.name()} sending step {step}: stopped while posting it ({err!r}); this transport "
                "is unusable: close() or abort() it"
            )
            if self._failure is None:
                self._failure = failure
            if works:
                self._pending.append((works, [meta, *payloads]))
            raise failure from err
        self._pending.append((works, [meta, *payloads]))
        self._send_step = step
        if _faults.hook is not None:
            _faults.hook("step:after_meta")

    def recv(self, wait: bool = True) -> dict[str, torch.Tensor] | ReceivedStep:
        """Receive the next step into the persistent tensors; return views with this step's rows.

        Blocks the host until the metadata arrives (at most the timeout),
        then posts the data receives. With NCCL the wait for them is then
        ordered on the caller's current stream without blocking the host;
        with gloo the host waits for them (at most the timeout). With
        ``wait=False`` the receives are posted the same way (the transfer
        runs), but that wait happens only at first use of the returned
        :class:`ReceivedStep` (or its ``wait(stream)``), on the stream current
        then (or ``stream``). The next ``recv()`` waits for an unused one
        first. The views are the persistent tensors, which the next step
        overwrites: consume or copy them before its ``recv()``.

        Raises:
            PeerTimeoutError: the previous stage sent nothing within the timeout or its connection broke.
            TypeError: ``wait`` is not a bool (the seed's ``recv(pp_group)``).
        """
        self._check_usable()
        check_wait(wait)
        if self._stages.prev_rank is None:
            raise RuntimeError(f"{self._stages.name()} is the first stage: it has no previous stage to receive from")
        if self.device.type == "cuda":
            refuse_graph_capture(self._stages.name(), "recv")
        if self._deferred is not None:
            self._deferred.wait()
        step = self._recv_step + 1
        what = f"{self._stages.name()} receiving step {step}"
        names = list(self._recv_specs)
        self._host_waiting = True  # before the last check: an abort() or close() from now on breaks the wait
        try:
            self._check_usable()
            meta = recv_meta(
                self._side_group, self._stages.prev_rank, self._meta_tag, 1 + len(names), self._timeout_s, what
            ).tolist()
        except BaseException as err:  # an interrupt too: whether the metadata was consumed is unknown
            self._raise_stopped(what, err)
            if self._failure is None:
                self._failure = err if isinstance(err, PeerTimeoutError) else TransportFailedError(
                    f"{what}: interrupted while receiving its metadata ({err!r}); this transport is unusable")
            raise
        finally:
            self._host_waiting = False
        rows = dict(zip(names, meta[1:]))
        if meta[0] != step or not rows_are_valid(meta[1:], self._recv_specs):
            self._failure = TransportFailedError(f"{what}: the peer's metadata {meta} does not match (protocol error)")
            raise self._failure
        try:
            finish = self._recv_data(step, what, names, rows)
            if wait:
                return finish(None, False)
        except BaseException as err:
            if self._failure is None:
                self._failure = TransportFailedError(
                    f"{what}: stopped after its metadata arrived ({err!r}); this transport is unusable")
            raise
        order = (self._current_stream, self._order_reader) if self.device.type == "cuda" else None
        self._deferred = ReceivedStep([n for n in names if rows[n] != ABSENT], finish, order)
        return self._deferred

    def _current_stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _order_reader(self, reader: int) -> None:
        """Make ``reader``, a later stream reading a deferred step already finished, wait for the step's end
        (``_received``, recorded after its receives and copies; a later step records it again, later)."""
        if self._received is not None:
            torch.cuda.ExternalStream(reader, device=self.device).wait_event(self._received)

    def _raise_stopped(self, what: str, err: BaseException) -> None:
        """Raise what ended a host wait from another thread (abort(): its error; close(): the closed error)."""
        if self._failure is not None and self._failure is not err:
            raise self._failure from err
        if self._failure is None and self._closed:
            raise TransportClosedError(f"{what}: this transport was closed while the host waited") from err

    def _recv_data(self, step: int, what: str, names: list[str], rows: dict[str, int]) -> Any:
        """Post step ``step``'s data receives; return what waits for them (on a stream, or the host for gloo)."""
        import torch.distributed as dist

        targets = [self._persistent[n][: rows[n]] for n in names if rows[n] > 0]
        if self._stage_via_host:
            landing = [torch.empty(t.shape, dtype=t.dtype) for t in targets]
        else:
            landing = targets
        works = self._post(dist.irecv, landing, self._stages.prev_rank)
        self._recv_step = step  # posted: the next step's receives go after these

        def finish(stream: int | None, deferred: bool = True) -> dict[str, torch.Tensor]:
            self._deferred = None
            if self._failure is not None:
                raise self._failure
            self._host_waiting = self._host_waits
            try:
                with _on_stream(self.device, stream):
                    for work in works:
                        if self._host_waits:
                            work.wait(timeout=timedelta(seconds=self._timeout_s))
                        else:
                            work.wait()
                    if self._stage_via_host:
                        for target, landed in zip(targets, landing):
                            target.copy_(landed)
                    if deferred and self._received is not None:
                        self._received.record()  # where a later reader of a deferred step waits (_order_reader)
            except RuntimeError as err:
                self._raise_stopped(what, err)
                self._failure = PeerTimeoutError(
                    f"{what}: the data did not arrive within {self._timeout_s:g} s: {peer_error_text(err)}"
                )
                raise self._failure from err
            finally:
                self._host_waiting = False
            return received_views(self._persistent, names, [rows[n] for n in names])

        return finish

    def _post(self, op: Any, tensors: list[torch.Tensor], peer: int) -> list[Any]:
        import torch.distributed as dist

        if not tensors:
            return []
        if self._batch:
            ops = [dist.P2POp(op, t, peer, self._group, self._data_tag) for t in tensors]
            return list(dist.batch_isend_irecv(ops))
        return [op(t, peer, group=self._group, tag=self._data_tag) for t in tensors]

    def _reap(self) -> None:
        """Drop finished sends; past ``MAX_SENDS_IN_FLIGHT``, wait for the oldest (gloo reports a send
        complete only from ``wait()``, so without this every step's buffers would stay alive)."""
        while self._pending and all(w.is_completed() for w in self._pending[0][0]):
            self._pending.popleft()
        while len(self._pending) >= MAX_SENDS_IN_FLIGHT:
            works, _buffers = self._pending[0]
            try:
                self._wait_sent(works)
            except RuntimeError as err:
                self._failure = PeerTimeoutError(
                    f"{self._stages.name()}: a send of {MAX_SENDS_IN_FLIGHT} steps ago did not complete (its "
                    f"connection broke, or the timeout of {self._timeout_s:g} s passed); the next stage died or "
                    f"stopped receiving: {peer_error_text(err)}"
                )
                raise self._failure from err
            self._drop_sent(works)

    def _wait_sent(self, works: list[Any]) -> None:
        """Wait for one step's sends: the host for gloo (at most the timeout), the current stream for NCCL.

        After this, dropping the step's buffers is safe: NCCL's ``wait()`` orders the current
        stream, on which the clones were allocated, after the send.
        """
        for work in works:
            if self._host_waits or work is works[0]:
                work.wait(timeout=timedelta(seconds=self._timeout_s))
            else:
                work.wait()

    def _drop_sent(self, works: list[Any]) -> None:
        """Drop the oldest pending step once waited for, if it is still ``works``' step.

        An ``abort()`` during the wait (a signal handler, another thread) has emptied the list already.
        """
        if self._pending and self._pending[0][0] is works:
            self._pending.popleft()

    def _wait_delivered(self, works: list[Any]) -> None:
        """Block the host until one step's sends completed (at most the timeout); close() uses it.

        For NCCL, ``wait()`` only orders a stream: a stage that closed and exited at once could leave
        its last data unsent, and the next stage's receive (posted after the metadata) waiting for ever.
        """
        if self._host_waits:
            self._wait_sent(works)
            return
        works[0].wait(timeout=timedelta(seconds=self._timeout_s))
        deadline = time.monotonic() + self._timeout_s
        for work in works[1:]:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the data did not go out within {self._timeout_s:g} s")
                time.sleep(0.0005)

    def close(self) -> None:
        """Finish this stage's sends, then refuse further calls; never waits for the peer to call close().

        Blocks the host until every posted send completed (at most the
        timeout each), then ends a ``recv()`` waiting on another thread
        (it raises :class:`~syncless.TransportClosedError`) and destroys the
        transport's private gloo group; after
        a failure, or once one send did not complete, it waits for none (their
        buffers are dropped: the backend holds what it still needs). Local: no
        collective. Resumable: an interrupted close() is finished by the next.
        """
        deferred = self._deferred
        if deferred is not None and self._failure is None and not self._closed:
            try:  # a step recv(wait=False) returned that nobody used: its receives complete before we go
                deferred.wait()
            except RuntimeError as err:  # recorded as the failure; close() goes on
                logger.warning("%s: finishing the last received step in close(): %s", self._stages.name(), err)
        self._closed = True
        while self._pending:
            works, _buffers = self._pending[0]
            if self._failure is None:
                try:
                    self._wait_delivered(works)
                except RuntimeError as err:
                    said = peer_error_text(err)
                    logger.warning("%s: a send did not complete before close(): %s", self._stages.name(), said)
                    self._failure = PeerTimeoutError(f"{self._stages.name()}: a send did not complete: {said}")
            self._drop_sent(works)
        if _faults.hook is not None:
            _faults.hook("close")
        if self._host_waiting:  # a recv() on another thread waits in gloo: only breaking the group ends that
            break_side_group(self._side_group, self._stages.prev_rank, self._stages.name())
        self._forget_links()
        # Last: what was posted on it is done or dropped. Local (destroying a gloo group is no collective).
        self._group = None
        self._release_side_group()

    def abort(self) -> int:
        """Refuse every later call on this stage (local, no collective); return :attr:`leaked_nbytes`.

        Usable from a signal handler or another thread. Closes the private
        gloo group's connections (about 1 ms: ``break_side_group``), so a
        ``recv()`` waiting there on another thread raises this abort's
        :class:`~syncless.TransportFailedError` at once, and the peers see
        the connections end. Posted sends are left to the backend. On NCCL
        a receive whose peer is gone stays queued on the stream it was
        ordered on (the process group's own timeout and
        ``torch.distributed``'s abort handle that group): rebuild on a new
        group (``docs/pp.md``: rebuilding).
        """
        self._closed = True
        if self._failure is None:
            self._failure = TransportFailedError(f"{self._stages.name()}: this transport was aborted")
        self._pending = deque()
        # Ends a recv() waiting in gloo on another thread at once, and the peers see the connections end.
        peer = self._stages.prev_rank if self._stages.prev_rank is not None else self._stages.next_rank
        break_side_group(self._side_group, peer, self._stages.name())
        return self.leaked_nbytes

    @property
    def leaked_nbytes(self) -> int:
        """What the copy-engine set-up that failed before this fallback kept by design (0 without one).

        This transport itself keeps no device memory a peer maps.
        """
        return self._setup_leaked_nbytes

"""The copy-engine transport's receiving half: ``recv()``, its deferred form, and the GPU half of a step.

A mixin of :class:`~syncless.pp._copy_engine.CopyEngineTransport` (kept apart so each module stays
readable); the protocol and every ordering it relies on are argued in ``_copy_engine``'s module
docstring, and ``depth="auto"``'s receiving side is in ``_copy_engine_auto``. A step's receive is
split in two: what ``recv()`` enqueues at once (depth 0: the ``empty`` write; ``"auto"``: its entry
write, enqueued before the metadata read), and its GPU half (the wait for the data, the copy out of
the slot), enqueued right away by ``recv()`` or, with ``recv(wait=False)``, at the first use of the
:class:`~syncless.pp._received.ReceivedStep`. Both halves go on the stream that was current at
``recv()``, so every ordering argued per stream holds unchanged; a first use on another stream makes
that stream wait for the half's ``post`` event::

    stream at recv():   [empty = N (depth 0)] ...input preparation... wait full >= N, copy-in, (post)
    stream at first use:                                                                 wait post, readers
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from syncless._core.errors import PeerTimeoutError, TransportFailedError
from syncless.pp._base import check_wait, refuse_graph_capture
from syncless.pp._layout import ABSENT, dense_spans, received_views, rows_are_valid
from syncless.pp._received import ReceivedStep
from syncless.pp._watchdog import Bracket


class CopyEngineReceiving:
    """``recv()`` of the copy-engine transport (a mixin; the attributes are the transport's)."""

    _deferred: ReceivedStep | None = None  # a step recv(wait=False) returned whose GPU half is not enqueued yet

    def recv(self, wait: bool = True) -> dict[str, torch.Tensor] | ReceivedStep:
        """Receive the next step into the persistent tensors; return views with this step's rows.

        Blocks the host until the step's metadata arrives (at most the
        timeout; a few microseconds when the sender is ahead), then enqueues
        on the caller's current stream of this stage's GPU: wait for the
        data, copy it into the persistent tensors, tell the sender the slot
        is free. Earlier work on that stream overlaps the transfer; later
        work sees the data. With depth 0: tell the sender the persistent
        tensors are free (everything queued before is done), then wait for
        its copies into them; the transfer starts only then. With
        ``depth="auto"``: that first write, then a message to the sender that
        this step is posted (before the metadata is read), then the half the
        step's path needs (``_copy_engine_auto``).

        With ``wait=False`` the host part is the same, and the step's first
        write (depth 0, ``"auto"``) still goes on the current stream here, but
        the GPU wait and the copy-in are enqueued only at first use of the
        returned :class:`ReceivedStep` (or its ``wait(stream)``), on the
        stream that was current at ``recv()``, behind the work queued there
        since (input preparation then overlaps the transfer); the stream
        current at first use (or ``stream``) then waits for them. The next
        ``recv()`` enqueues an unused one first.

        The views are the persistent tensors: the next step overwrites them
        in place, in stream order (from its ``recv()`` on with depth 0 and
        ``"auto"``, from its wait with depth >= 1), so consume or copy them
        before that step's ``recv()``.

        Raises:
            TypeError: ``wait`` is not a bool (the seed's ``recv(pp_group)``).
            PeerTimeoutError: the previous stage sent nothing within the timeout, or an earlier step timed out.
            RuntimeError: this is the first stage, the transport is closed, the peer's metadata does not
                match (protocol error), or an earlier step failed part-way (the transport is unusable).
        """
        if self._closed or self._failure is not None:
            self._check_usable()
        check_wait(wait)
        if self._stages.prev_rank is None:
            raise RuntimeError(f"{self._stages.name()} is the first stage: it has no previous stage to receive from")
        refuse_graph_capture(self._stages.name(), "recv")
        self._in_call = True
        try:
            if self._deferred is not None:  # a step recv(wait=False) returned and nobody used yet goes first
                self._deferred.wait()
            return self._recv(wait)
        finally:
            self._in_call = False

    def _recv(self, wait: bool) -> dict[str, torch.Tensor] | ReceivedStep:
        step = self._recv_step + 1
        if self._auto_recv is not None:
            self._enter_auto(step)  # before the metadata read: see _copy_engine_auto
        try:
            meta = self._parts.meta_in.recv(self._timeout_s, self._recv_what.format(step))
        except BaseException as err:  # an interrupt too: part of a message may have been read
            if self._failure is not None and self._failure is not err:
                # An abort() on another thread shut the socket (or the watchdog gave up): its error is this
                # call's, as every later call's, not the closed socket it caused.
                raise self._failure from err
            if self._failure is None:
                self._failure = err if isinstance(err, PeerTimeoutError) else TransportFailedError(
                    f"{self._recv_what.format(step)}: interrupted while reading its metadata ({err!r}); "
                    "this transport is unusable: close() or abort() it"
                )
            raise
        try:
            if self._auto_recv is not None:
                direct, rows = self._check_auto_meta(step, meta)
                stream = self._entered_stream
                half = functools.partial(self._finish_auto, step, direct, rows)
            else:
                rows = self._check_meta(step, meta)
                stream = self._caller_stream()
                half = self._recv_start(step, rows, stream)
        except BaseException as err:  # the metadata is consumed: a step left half-done poisons the transport
            self._fail_mid_step(f"receiving step {step}", err)
            raise
        if wait:
            return self._recv_finish(step, half, stream, rows, None)
        deferred = ReceivedStep(
            [name for name, count in zip(self._recv_layout.names, rows) if count != ABSENT],
            functools.partial(self._finish_deferred, step, half, stream, rows),
            (self._caller_stream, functools.partial(self._order_reader, stream)),
        )
        self._deferred = deferred
        return deferred

    def _finish_deferred(self, step: int, half: Any, stream: int, rows: Any,
                         consumer: int | None) -> dict[str, torch.Tensor]:
        """First use of a step recv(wait=False) returned: enqueue its GPU half now (see recv())."""
        if self._closed or self._failure is not None:
            self._check_usable()
        nested = self._in_call  # from recv(), which finishes the previous step first
        self._in_call = True
        try:
            return self._recv_finish(step, half, stream, rows, consumer)
        finally:
            self._in_call = nested

    def _recv_finish(self, step: int, half: Any, stream: int, rows: Any,
                     consumer: int | None) -> dict[str, torch.Tensor]:
        """Enqueue step ``step``'s GPU half on ``stream``; fence ``consumer`` (default: the current stream)."""
        self._deferred = None
        try:
            pre, post = half()
            target = self._caller_stream() if consumer is None else consumer
            if target != stream:
                # The caller reads the data on another stream than the step's: it waits for the step's
                # end (`post`, just recorded on `stream`), before the watchdog may recycle the event.
                pushed = self._binding.enter()
                try:
                    self._hot.wait_event(post, target)
                finally:
                    self._binding.exit(pushed)
        except BaseException as err:
            self._fail_mid_step(f"receiving step {step}", err)
            raise
        return self._recv_done(stream, pre, post, step, rows)

    def _order_reader(self, stream: int, reader: int) -> None:
        """Make ``reader``, a later stream reading a deferred step already finished, wait for the step's end.

        ``received`` was recorded on ``stream`` after the step's half (the later steps' halves record it
        again, behind this one: waiting for them is late, never early). A closed or failed transport
        enqueues nothing (its events may be gone; close() waited for the step, abort() made it undefined).
        """
        if reader == stream or self._closed or self._failure is not None:
            return
        pushed = self._binding.enter()
        try:
            self._hot.wait_event(self._parts.received, reader)
        finally:
            self._binding.exit(pushed)

    def _check_meta(self, step: int, meta: tuple[int, ...]) -> tuple[int, ...]:
        """Return the row counts of a fixed-depth step's metadata; a mismatch poisons the transport."""
        rows = meta[1:]
        if meta[0] != step or not rows_are_valid(rows, self._recv_layout.specs):
            self._failure = TransportFailedError(
                f"{self._recv_what.format(step)}: the peer's metadata {meta} does not match (protocol error)"
            )
            raise self._failure
        return rows

    def _recv_start(self, step: int, rows: tuple[int, ...], current: int) -> Any:
        """Enqueue what a fixed-depth step needs at recv() (depth 0: the `empty` write); return the rest."""
        spans, _ = dense_spans(self._recv_row_nbytes, rows)
        parts, hot = self._parts, self._hot
        slot_base = self._recv_slots[(step - 1) % self.depth] if self.depth else 0
        if self.depth == 0:
            pushed = self._binding.enter()
            try:
                if self._last_recv_stream not in (None, current):
                    hot.wait_event(parts.received, current)  # `empty` only grows (see the depth >= 1 half)
                # Depth 0: everything queued here before recv(), readers of the last step included, is
                # done when this write runs, so the sender may copy step N into the persistent tensors.
                hot.write(current, self._prev_empty, step)
            finally:
                self._binding.exit(pushed)
            self._last_recv_stream = current

        def rest() -> tuple[Any, Any]:
            pushed = self._binding.enter()
            try:
                pre, post = parts.acquire_event(), parts.acquire_event()
                if self.depth:
                    if self._last_recv_stream not in (None, current):
                        # Slots are freed in order whatever stream each recv() runs on: this step's `empty`
                        # write comes after the previous step's, so `empty` only grows.
                        hot.wait_event(parts.received, current)
                    hot.record(pre, current)
                    hot.wait_geq(current, self._full, step)
                    for target, (offset, nbytes) in zip(self._recv_targets, spans):
                        if nbytes:
                            hot.memcpy(target, slot_base + offset, nbytes, current)
                    hot.write(current, self._prev_empty, step)
                else:
                    hot.record(pre, current)
                    hot.wait_geq(current, self._full, step)
                hot.record(parts.received, current)
                hot.record(post, current)
            finally:
                self._binding.exit(pushed)
            return pre, post

        return rest

    def _recv_done(self, stream: int, pre: Any, post: Any, step: int, rows: Any) -> dict[str, torch.Tensor]:
        """After a step's receive was enqueued on ``stream`` (bracketed by ``pre``/``post``): watch it, count it,
        and return the views of the persistent tensors with its rows (host-only bookkeeping)."""
        self._last_recv_stream = stream
        self._watchdog.watch(Bracket(stream, pre, post, self._recv_what, step))
        self._recv_step = step
        return received_views(self._persistent, self._recv_layout.names, rows)

    # Provided by the transport and its other mixins.
    _parts: Any
    _stages: Any
    _hot: Any
    _binding: Any
    _watchdog: Any
    _persistent: dict[str, torch.Tensor]
    _failure: BaseException | None
    _closed: bool
    _in_call: bool

    def _caller_stream(self) -> int:  # pragma: no cover - the transport defines it
        raise NotImplementedError

"""The host side of ``depth="auto"``: posting, choosing, metadata, brackets and failures around ``_auto``.

A mixin of :class:`~syncless.pp._copy_engine.CopyEngineTransport` (kept apart
so each module stays readable). ``_auto`` is the protocol on the GPU and argues
every ordering; this module decides, per step, what the host does around it:

send(N):
    1. validate the step (nothing enqueued on a bad one);
    2. read, without blocking, every "posted recv(k)" the next stage sent (one
       ``readv``; ``_meta_channel.Sender.read_posted``), checked by ``_auto.PostedLog``;
    3. choose the path (``_auto.choose_direct``: direct only where the next stage
       shared its persistent tensors, posted recv(N), and the step has at least
       ``SYNCLESS_PP_AUTO_DIRECT_MIN_BYTES``);
    4. enqueue (``_auto.AutoSender``), then watch the step and send its metadata,
       the path bit after the step number.

recv(N):
    1. enqueue the entry write ``W = 2N-1`` on the current stream
       (``_auto.AutoReceiver.enter``), *then* post recv(N) to the sender: the sender
       can only choose direct after the write it will wait for is enqueued;
    2. read the metadata (blocking, as every depth does);
    3. check the path bit (direct only if this stage shared its tensors and posted
       N) and enqueue the matching half on the same stream.

A receiver posts only while this process has no link *to* the process it receives
from (``_auto``'s module docstring says why: a cycle through a slot wait). The
links of this process are kept by the peer's process id, read from the metadata
sockets (the torch.distributed transport's from set-up); every send link counts,
whatever its backend or depth. A link back makes both links slot-only at this
end, and the peer, which sees the same pair the other way round, stops posting too.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from syncless._core.errors import PeerTimeoutError, TransportFailedError
from syncless.pp._auto import AutoReceiver, AutoSender, PostedLog
from syncless.pp._layout import dense_spans, rows_are_valid
from syncless.pp._watchdog import Bracket

_log = logging.getLogger(__name__)


def _forget(sends_to: int | None, receives_from: int | None) -> None:
    _drop_link(_sends_to, sends_to)
    _drop_link(_receives_from, receives_from)


# The auto links of this process, by the peer's process id: how many send to it, how many receive from it.
# An RLock: close() may run again from a signal handler that interrupted it on the same thread.
_links_lock = threading.RLock()
_sends_to: collections.Counter = collections.Counter()
_receives_from: collections.Counter = collections.Counter()


def _add_link(table: collections.Counter, pid: int | None) -> None:
    if pid is not None:
        with _links_lock:
            table[pid] += 1


def _drop_link(table: collections.Counter, pid: int | None) -> None:
    if pid is not None:
        with _links_lock:
            table[pid] -= 1
            if table[pid] <= 0:
                del table[pid]


def record_send_link(owner: object, sends_to: int | None) -> weakref.finalize:
    """Count a send link of this process to process ``sends_to`` for as long as ``owner`` lives (any backend,
    any depth: an ``"auto"`` link that receives from that process must see it); return the finalizer that
    drops it (``close()`` calls it)."""
    _add_link(_sends_to, sends_to)
    forget = weakref.finalize(owner, _forget, sends_to, None)
    forget.atexit = False
    return forget


def links_back_to(pid: int | None) -> bool:
    """Whether this process also sends to ``pid`` (the process one of its auto links receives from).

    Stages in one process (threads) are not told apart this way: their links are not counted as links back.
    """
    return pid is not None and pid != os.getpid() and _sends_to.get(pid, 0) > 0


class AutoCalls:
    """``depth="auto"``'s send() and recv() (a mixin; the attributes are the transport's)."""

    _auto_send: AutoSender | None = None
    _auto_recv: AutoReceiver | None = None
    #: steps this stage sent straight into the next stage's persistent tensors (``depth="auto"`` only)
    direct_steps_sent: int = 0

    def _set_up_auto(self, auto: bool, slots: int, direct_min_nbytes: int) -> None:
        """Build the auto sender and receiver of this stage's links (nothing with a fixed depth)."""
        self._auto_send = None
        self._auto_recv = None
        self.direct_steps_sent = 0
        self._receives_from_pid = None
        parts = self._parts
        stages = self._stages
        sends_to = parts.meta_out.peer_pid() if parts.meta_out is not None else None
        if not auto:
            # Every send link counts, whatever its depth: a fixed-depth link back to the process an "auto"
            # link of this process receives from closes the same cycle through a slot wait (_auto).
            self._forget_links = record_send_link(self, sends_to)
            return
        receives_from = parts.meta_in.peer_pid() if parts.meta_in is not None else None
        _add_link(_sends_to, sends_to)
        _add_link(_receives_from, receives_from)
        self._receives_from_pid = receives_from
        # Dropped when the transport is closed or collected (an abort() keeps them: it may run in a signal
        # handler, and a link kept too long only makes steps go through slots).
        self._forget_links = weakref.finalize(self, _forget, sends_to, receives_from)
        self._forget_links.atexit = False
        if self._send_layout is not None:
            targets = parts.next_targets if parts.next_direct_problem is None else None
            self._auto_send = AutoSender(
                self._hot, parts.acquire_event, slots=slots, peer_slots=self._next_slots, targets=targets,
                peer_full=self._next_full, own_w=self._empty, relay=parts.relay_stream, sent=parts.sent,
                min_nbytes=direct_min_nbytes,
            )
            self._posted_log = PostedLog(f"{stages.name()} sending to {stages.name(stages.index + 1)}")
        if stages.prev_rank is not None:
            self._auto_recv = AutoReceiver(
                self._hot, slots=self._recv_slots, targets=self._recv_targets, own_full=self._full,
                peer_w=self._prev_empty, received=parts.received,
            )
            self._direct_in = parts.direct_problem is None  # whether the previous stage may send direct
            self._posting = True  # False once a post could not be sent: the sender then never sends direct
            self._posted_step = 0  # the last recv() posted to the sender
            self._entered_stream = 0  # the stream the current recv()'s entry write went on

    # -- sending ---------------------------------------------------------------------

    def _send_auto(self, tensors: Mapping[str, torch.Tensor]) -> None:
        rows = self._send_check.rows(tensors)
        step = self._send_step + 1
        auto = self._auto_send
        spans, _ = dense_spans(self._send_row_nbytes, rows)
        posted = self._read_posted(step)
        direct = auto.choose(step, posted, sum(nbytes for _, nbytes in spans))
        destinations = auto.destinations(step, direct, [offset for offset, _ in spans])
        # Non-contiguous inputs become contiguous temporaries on the current stream; freeing them after
        # this call is safe for the same reason as with a fixed depth: the caller's stream runs the direct
        # copies itself, or waits for the relay's `post` before anything it queues later.
        dense, copies = self._step_copies(tensors, destinations, spans)
        pushed = self._binding.enter()
        plan = None
        try:
            plan = auto.plan(direct, self._caller_stream())
            auto.enqueue(plan, step, copies)
        except BaseException as err:
            self._fail_mid_step(f"sending step {step}", err)
            if plan is not None and plan.enqueued:
                self._watch_after_failure(plan.stream, plan.pre, plan.post, step, plan.caller if plan.relayed else None)
            raise
        finally:
            self._binding.exit(pushed)
        self._last_send_stream = plan.stream
        bracket = Bracket(plan.stream, plan.pre, plan.post, self._send_what, step, waited=plan.waited, ready=plan.ready)
        self._send_metadata(step, [int(direct), *rows], bracket)
        if direct:
            self.direct_steps_sent += 1

    def _read_posted(self, step: int) -> int:
        """Take every "posted" message that has arrived (never blocks); return the last step posted.

        A failed read (the next stage closed its end or died) is reported like a failed metadata send, a
        value out of order like a protocol error: either makes the transport unusable, before anything of
        step ``step`` is enqueued.
        """
        try:
            return self._posted_log.accept(self._parts.meta_out.read_posted(), step)
        except BaseException as err:  # an interrupt too: values read but not taken would look out of order later
            if isinstance(err, PeerTimeoutError):
                failure: BaseException = PeerTimeoutError(
                    f"{self._stages.name()} sending step {step}: {err}; this transport is unusable: close() or "
                    "abort() it"
                )
            elif isinstance(err, TransportFailedError):
                failure = err
            else:
                failure = TransportFailedError(
                    f"{self._stages.name()} sending step {step}: interrupted while reading what the next stage "
                    f"posted ({err!r}); this transport is unusable: close() or abort() it"
                )
            if self._failure is None:  # an abort() on another thread may have come first: it stays the error
                self._failure = failure
            if failure is err:
                raise
            raise failure from err

    # -- receiving -------------------------------------------------------------------

    def _enter_auto(self, step: int) -> None:
        """Enqueue recv(``step``)'s entry write on the current stream, then post recv(``step``) to the sender."""
        pushed = self._binding.enter()
        try:
            stream = self._caller_stream()
            self._auto_recv.enter(step, stream)
        except BaseException as err:
            self._fail_mid_step(f"receiving step {step}", err)
            raise
        finally:
            self._binding.exit(pushed)
        self._entered_stream = stream
        if not self._posting or self._posted_step >= step:
            return  # a post failed earlier; or recv(step) was posted by a call interrupted after it (no repeat)
        if links_back_to(self._receives_from_pid):
            self._stop_posting_for_the_link_back()
            return
        try:
            self._posting = self._parts.meta_in.post(step)
        except BaseException as err:  # an interrupt part-way through the message: the sender could misread it
            if self._failure is None:
                self._failure = TransportFailedError(
                    f"{self._recv_what.format(step)}: interrupted while posting it to the previous stage ({err!r}); "
                    "this transport is unusable: close() or abort() it"
                )
            raise
        if self._posting:
            self._posted_step = step

    def _stop_posting_for_the_link_back(self) -> None:
        """This process also sends to the process this link receives from: post no more (every step of this
        link goes through a slot from now on; steps already posted keep their path). Logged once."""
        self._posting = False
        if self.direct_unavailable_reason is None:
            self.direct_unavailable_reason = (
                f"steps into {self._stages.name()} go through a slot: this process also sends to the process it "
                "receives from, and depth=\"auto\" sends direct only along stage graphs without cycles"
            )
        _log.info("%s", self.direct_unavailable_reason)

    def _check_auto_meta(self, step: int, meta: tuple[int, ...]) -> tuple[bool, tuple[int, ...]]:
        """Check the step's metadata (the path bit, the row counts); return ``(direct, rows)``."""
        layout = self._recv_layout
        path, rows = meta[1], meta[2:]
        valid = meta[0] == step and path in (0, 1) and rows_are_valid(rows, layout.specs)
        direct = path == 1
        if not valid or (direct and not (self._direct_in and self._posted_step == step)):
            why = ("a direct step it may not send: this stage " + (
                "shared no persistent tensors" if not self._direct_in else f"had not posted recv({step})"
            )) if valid else "does not match"
            self._failure = TransportFailedError(
                f"{self._recv_what.format(step)}: the peer's metadata {meta} {why} (protocol error)"
            )
            raise self._failure
        return direct, rows

    def _finish_auto(self, step: int, direct: bool, rows: tuple[int, ...]) -> tuple[Any, Any]:
        """Enqueue the path's half of a checked step on the stream of its entry write; return ``(pre, post)``.

        Always that stream, also when recv(wait=False) deferred it: ``_auto`` argues the step's orderings
        with its entry write and its half on one stream.
        """
        spans, _ = dense_spans(self._recv_row_nbytes, rows)
        parts = self._parts
        pushed = self._binding.enter()
        try:
            pre, post = parts.acquire_event(), parts.acquire_event()
            self._auto_recv.finish(step, direct, spans, self._entered_stream, pre, post)
        finally:
            self._binding.exit(pushed)
        return pre, post

    # Provided by the transport.
    _parts: Any
    _stages: Any
    _hot: Any
    _binding: Any
    _watchdog: Any
    _persistent: dict[str, torch.Tensor]
    _failure: BaseException | None

    def _caller_stream(self) -> int:  # pragma: no cover - the transport defines it
        raise NotImplementedError

    def _recv_done(self, stream: int, pre: Any, post: Any, step: int, rows: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError  # pragma: no cover - the transport defines it

    def _step_copies(self, tensors: Mapping[str, torch.Tensor], destinations: Any, spans: Any) -> tuple:
        raise NotImplementedError  # pragma: no cover - the transport defines it

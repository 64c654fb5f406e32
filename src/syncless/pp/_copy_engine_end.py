"""The copy-engine transport's failures and its end: errors, the watchdog's release, close(), abort().

A mixin of :class:`~syncless.pp._copy_engine.CopyEngineTransport` (kept
apart so each module stays readable); the order of the tear-down itself is
``_teardown``. ``docs/pp.md`` (failure model) is the user's side of it.

What may be freed when (see ``_teardown``): what only this process uses,
always; its mappings of the peers' memory, once this GPU's queued work is
done; its own buffer (and at depth 0 the persistent tensors), only after a
barrier in which every stage confirmed it unmapped them, else kept for the
life of the process and counted in ``leaked_nbytes``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from syncless._core.errors import PeerTimeoutError, TransportFailedError
from syncless.pp import _driver as drv
from syncless.pp import _faults
from syncless.pp._teardown import Teardown
from syncless.pp._watchdog import Watchdog

logger = logging.getLogger(__name__)


class CopyEngineEnding:
    """Failure bookkeeping and tear-down of a copy-engine transport (a mixin; the attributes are the transport's)."""

    _failure: BaseException | None
    _closed: bool
    #: close() is waiting for this GPU's queued steps: abort() meanwhile leaves the GPU objects to it
    _draining: bool = False

    def _fail_mid_step(self, what: str, err: BaseException) -> None:
        """A driver call failed with part of a step enqueued: the flags no longer match the steps, so stop."""
        if self._failure is None:
            failure = TransportFailedError(f"{self._stages.name()} {what}: {err!r}; part of the step was enqueued, "
                                           "so this transport is unusable: close() or abort() it")
            failure.__cause__ = err
            self._failure = failure

    @property
    def leaked_nbytes(self) -> int:
        """Device bytes kept allocated on purpose by ``close()``/``abort()``: a peer may still map them.

        0 after a clean ``close()``. See ``docs/pp.md`` (failure model).
        """
        return self._teardown.leaked_nbytes

    def _forked(self) -> None:
        """In a forked child (``_fork``): nothing here is usable; release nothing (it is the parent's)."""
        self._closed = True
        self._failure = TransportFailedError(
            f"{self._stages.name()}: this transport belongs to the process that forked this one; CUDA and the "
            "metadata sockets do not survive a fork. Build a transport in the child instead"
        )
        self._finalizer.detach()
        self._teardown.abandon()

    def _on_timeout(self, what: str, waited_s: float) -> None:
        """Watchdog thread: record the error and release every wait on our flags (once per stuck wait)."""
        undefined = {0: "whatever had landed", "auto": "bytes 0xFF after a slot step, whatever had landed after a "
                     "direct one"}.get(self.depth, "bytes 0xFF")
        err = PeerTimeoutError(
            f"{what}: the GPU waited {waited_s:.1f} s for the peer's flag (timeout {self._timeout_s:g} s); the peer "
            f"died or stopped. The waits were released; that step's received data is undefined ({undefined}). "
            "This transport is unusable: close() or abort() it."
        )
        if self._failure is None:
            self._failure = err
        if not self._released:
            logger.error("%s", err)
        else:  # a late peer wrote its flag over the release value; release again, quietly
            logger.debug("%s (released again)", err)
        self._release_waits()
        self._released = True

    def _release_waits(self) -> None:
        """Release every GPU wait on this stage's flags (the watchdog's timeout, close() after a failure, abort()).

        Enqueues on the private stream, which no transport wait is queued on: poison the receive slots
        (0xFF), then write the release value into ``full`` and ``empty``. Pushes the transport's
        context for the calls. Does not block the host.
        """
        with self._ctx:
            self._release()

    _deferred: Any = None

    def close(self) -> None:
        """Wait for this stage's queued transfers, then unmap and free everything; every stage calls it.

        Blocks the host: until the GPU finished every enqueued step (stuck
        waits are released by the watchdog after the timeout, so a send the
        next stage never received costs up to one timeout here: with depth 0
        a single one does, with depth D more than D; after a failure the
        waits are released at once), then for one barrier with the other
        stages (so no buffer is freed while a peer still maps it). If the
        barrier fails (a peer died, stalled or was interrupted), this
        stage's buffer (and at depth 0 its persistent tensors) is kept by
        design: a stalled peer may still map it. :attr:`leaked_nbytes` says
        how much, and a warning is logged. Enqueues nothing on the caller's
        streams, except that a step returned by ``recv(wait=False)`` and never
        used is finished first: its wait and copy-in go on the caller's current
        stream, as its first use would have put them.

        Resumable: interrupted (``KeyboardInterrupt``), the next ``close()``
        (or ``abort()``) goes on where it stopped; once finished it does
        nothing.
        """
        deferred = self._deferred
        if deferred is not None and not deferred.waited and self._failure is None and not self._closed:
            # A step recv(wait=False) returned that nobody used: consume it, so the sender's steps drain.
            try:
                deferred.wait()
            except Exception as err:  # noqa: BLE001 - recorded as the transport's failure; close() goes on
                logger.warning("%s: finishing the last received step in close(): %s", self._stages.name(), err)
        self._closed = True
        forget_links = getattr(self, "_forget_links", None)  # depth="auto": this process's links (host-only)
        if forget_links is not None:
            forget_links()
        if self._teardown.finished:
            self._release_side_group()  # after an abort(), which leaves it: no process group in a signal handler
            return
        if self._teardown.running:  # called again from a signal handler that interrupted close() itself
            return
        if not self._drained:
            # An abort() during the drain (a signal handler, another thread) must not destroy the events
            # and streams the drain still polls: it only releases and stops, and this close() goes on
            # (without a barrier, since abort() skipped it).
            self._draining = True
            try:
                self._gpu_idle = self._drain()
            finally:
                self._draining = False
            self._drained = True
        self._watchdog.stop()
        if _faults.hook is not None:
            _faults.hook("close")
        self._finish(collective=True)
        if self._teardown.finished:  # its barrier ran: the private gloo group is no longer needed
            self._release_side_group()

    def abort(self) -> int:
        """Stop now, on this stage only; return the bytes kept by design (also :attr:`leaked_nbytes`).

        Local and non-collective, like ``ncclCommAbort``: usable from a
        signal handler or another thread while a ``send()``/``recv()`` or
        ``close()`` runs. Records the error every later call raises
        (:class:`~syncless.TransportFailedError`), releases every GPU wait on
        this stage's flags (the data of steps in flight is undefined), shuts
        the metadata sockets (a ``recv()`` blocked in them returns at once),
        and stops the watchdog. Then, unless another call is running on the
        transport, releases what is safe without the peers: sockets,
        streams, events, and its mappings of the peers' memory once this
        GPU's work is done (waits at most about a second for that). What a
        peer may still map (this stage's buffer; at depth 0 its persistent
        tensors) is kept for the life of the process. A later ``close()``
        finishes what was left, without a barrier. Enqueues only on the
        private stream; blocks the host for at most about a second.
        """
        self._closed = True
        if self._failure is None:
            self._failure = TransportFailedError(
                f"{self._stages.name()}: this transport was aborted; build a new one (docs/pp.md: rebuilding)"
            )
        self._teardown.skip_barriers()
        if self._teardown.finished:
            return self.leaked_nbytes
        try:
            self._release_waits()
        except Exception as err:  # noqa: BLE001 - abort goes on: the rest may still be released
            logger.warning("%s: abort could not release the GPU waits: %s", self._stages.name(), err)
        for endpoint in (self._parts.meta_in, self._parts.meta_out):
            if endpoint is not None:
                endpoint.shutdown()
        busy = self._in_call or self._draining or self._teardown.running
        # Never join the watchdog while a call runs: a signal handler may have interrupted that call (on
        # this very thread) inside `with watchdog._lock`, and the watchdog thread would then wait on that
        # lock forever, and this join with it. With no call running, nothing of this transport holds the
        # lock here; the join is bounded all the same.
        self._watchdog.stop(join=not busy and threading.current_thread() is not self._watchdog.thread,
                            timeout_s=1.0)
        if busy:
            return self.leaked_nbytes  # the running call owns the GPU objects now; close() finishes later
        if not self._drained:
            self._gpu_idle = self._watchdog.wait_idle(deadline_s=1.0)
            self._drained = True
        self._finish(collective=False)
        return self.leaked_nbytes

    def _drain(self) -> bool:
        """Wait (bounded) until every watched step finished; return whether this GPU's work is done."""
        if self._failure is not None:
            # Nothing more is coming from the peers' side that we would wait for: release at once.
            try:
                self._release_waits()
            except Exception as err:  # noqa: BLE001 - then the watchdog's own releases must do
                logger.warning("%s: releasing the GPU waits failed: %s", self._stages.name(), err)
        # Each stuck wait is released after one timeout; a released flag lets every later wait through.
        deadline_s = self._timeout_s * (self._watchdog.pending() + 2) + 1.0
        idle = self._watchdog.wait_idle(deadline_s=deadline_s)
        if not idle:
            logger.error("%s: the GPU did not finish the transport's queued steps within %.1f s; what it may "
                         "still touch is kept", self._stages.name(), deadline_s)
        return idle

    def _finish(self, *, collective: bool) -> None:
        """Run the tear-down (resumable) and report what was kept by design."""
        before = len(self._teardown.leaked)
        try:
            self._teardown.run(collective=collective, gpu_idle=self._gpu_idle)
        finally:
            if self._teardown.finished:
                self._finalizer.detach()
            kept = self._teardown.leaked[before:]
            if kept:
                logger.warning("%s: kept by design after %s (a peer may still map it): %s; %d bytes in all",
                               self._stages.name(), "close()" if collective else "abort()", "; ".join(kept),
                               self._teardown.leaked_nbytes)


def write_release(stream: int, region: int, poisoned_nbytes: int, full: int, empty: int) -> None:
    """Enqueue on ``stream``: fill ``poisoned_nbytes`` at ``region`` with 0xFF, then release both flags."""
    if poisoned_nbytes:
        drv.mem_fill_bytes(region, 0xFF, poisoned_nbytes, stream)  # every slot
    drv.write_value(stream, full, drv.RELEASE_VALUE)
    drv.write_value(stream, empty, drv.RELEASE_VALUE)


def release_dropped(teardown: Teardown, watchdog: Watchdog, ctx: drv.PrimaryContext, release: Any,
                     name: str) -> None:
    """Finalizer of a transport dropped without ``close()``: what abort() would release, nothing shared."""
    try:
        watchdog.stop(join=threading.current_thread() is not watchdog.thread)
        with ctx:
            release()
        idle = watchdog.wait_idle(deadline_s=0.5)
        teardown.run(collective=False, gpu_idle=idle)
    except Exception as err:  # noqa: BLE001 - a finalizer must not raise; say what happened
        logger.warning("%s: releasing a transport dropped without close() failed: %s", name, err)
        return
    logger.warning("%s: a copy-engine transport was dropped without close(); kept by design: %s (%d bytes)",
                   name, "; ".join(teardown.leaked) or "nothing", teardown.leaked_nbytes)

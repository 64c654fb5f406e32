"""Releasing what a copy-engine transport holds: in order, resumable, and never under a live peer.

What set-up makes falls in four kinds. :meth:`Teardown.run` releases every
``local`` and ``unmap`` entry first (last made first), then runs the barrier,
then the ``shared`` entries (last made first):

- ``local``: only this process uses it (sockets, streams, events): always released.
- ``unmap``: a peer's memory mapped here: unmapped only once this process's
  GPU work is done (a copy still queued into it would fault after the unmap).
- ``shared``: this process's memory a peer may map (its buffer, and at depth 0
  the persistent tensors): freed only after a barrier with every stage
  succeeded, which every stage enters after unmapping (a stage that had to
  leave a peer's memory mapped stays out of it). Otherwise it is leaked
  by design (kept allocated, and a tensor kept referenced for the life of the
  process) and its bytes are added to :attr:`Teardown.leaked_nbytes`: a peer
  that is stalled, not dead, may still read or write it, and CUDA leaves that
  undefined once it is freed.
- the barrier: the one collective, which tells whether the ``shared``
  entries may be freed (every stage unmapped what it mapped of ours).

:meth:`Teardown.run` pops each entry before running it, so an interrupt
(``KeyboardInterrupt``) leaves the rest for the next call, and an entry that
was interrupted is not run again; an interrupted or failed barrier counts as
failed. Plain Python over callables: unit-tested on the CPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Objects leaked by design (tensors a peer may still map): referenced here for the life of the process.
_KEPT: list[Any] = []
_kept_lock = threading.Lock()


def keep_forever(obj: Any) -> None:
    """Keep ``obj`` referenced until the process exits (so its memory is never freed or reused)."""
    with _kept_lock:
        _KEPT.append(obj)


@dataclass
class _Entry:
    kind: str  # "local", "unmap", "shared", "barrier"
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    nbytes: int = 0
    what: str = ""
    on_leak: Callable[[], None] | None = None


class Teardown:
    """An ordered list of release actions; see the module docstring.

    Attributes:
        leaked_nbytes: device bytes kept allocated on purpose (a peer may still map them).
        leaked: one line per leaked entry, for the log and the error messages.
    """

    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        self._barrier: _Entry | None = None
        self._exposed = False  # a barrier was registered: from then on a peer may map our memory
        self._peers_clear = True  # every barrier run so far succeeded
        self._left_mapped = False  # an unmap entry was skipped (this GPU's work was not finished)
        self._running = False
        self.leaked_nbytes = 0
        self.leaked: list[str] = []

    # -- registering, in the order things are made --------------------------------------

    def local(self, fn: Callable[..., Any], *args: Any) -> None:
        """Release with ``fn(*args)`` whatever happens (only this process uses it)."""
        self._entries.append(_Entry("local", fn, args))

    def unmap(self, fn: Callable[..., Any], *args: Any, what: str = "a peer mapping") -> None:
        """Release with ``fn(*args)`` once this process's GPU work is done; else leave it mapped."""
        self._entries.append(_Entry("unmap", fn, args, what=what))

    def shared(self, fn: Callable[..., Any], *args: Any, nbytes: int, what: str,
               on_leak: Callable[[], None] | None = None) -> None:
        """Free with ``fn(*args)`` only after a successful barrier; else keep it (``on_leak()``), count ``nbytes``."""
        self._entries.append(_Entry("shared", fn, args, nbytes=nbytes, what=what, on_leak=on_leak))

    def barrier(self, fn: Callable[..., bool], *args: Any) -> None:
        """Run ``fn(*args)`` (True: every stage got there) after every local release and unmap, before the frees."""
        self._barrier = _Entry("barrier", fn, args)
        self._exposed = True

    # -- releasing ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Whether every entry was run or leaked."""
        return not self._entries and self._barrier is None

    @property
    def running(self) -> bool:
        """Whether :meth:`run` is in progress (on any thread, or below us on this one)."""
        return self._running

    def abandon(self) -> None:
        """Forget every entry without running it (a forked child: everything belongs to the parent)."""
        self._entries.clear()
        self._barrier = None

    def skip_barriers(self) -> None:
        """Treat every barrier not yet run as failed (``abort()``: nothing collective any more)."""
        if self._exposed:
            self._peers_clear = False

    def run(self, *, collective: bool, gpu_idle: bool) -> None:
        """Release everything left, last registered first; see the module docstring.

        Args:
            collective: run the barriers (False: treat them as failed; nothing shared is freed).
            gpu_idle: this process's GPU work on the transport is done (False: leave peer mappings and
                shared memory as they are).

        Raises:
            the first error a release raised (after running the rest); an interrupt at once (the rest
            stays for the next call).
        """
        if not collective:
            self.skip_barriers()
        first_error: Exception | None = None
        self._running = True
        try:
            while (entry := self._next()) is not None:
                try:
                    self._run_one(entry, gpu_idle)
                except Exception as err:  # noqa: BLE001 - released the rest first, then raised below
                    logger.warning("syncless.pp: releasing %s failed: %s", entry.what or entry.kind, err)
                    if first_error is None:
                        first_error = err
        finally:
            self._running = False
        if first_error is not None:
            raise first_error

    def _next(self) -> _Entry | None:
        """Pop the next entry: the last local or unmap one, else the barrier, else the last shared one."""
        for index in range(len(self._entries) - 1, -1, -1):
            if self._entries[index].kind != "shared":
                return self._entries.pop(index)
        if self._barrier is not None:
            entry, self._barrier = self._barrier, None
            return entry
        return self._entries.pop() if self._entries else None

    def _run_one(self, entry: _Entry, gpu_idle: bool) -> None:
        if entry.kind == "local":
            entry.fn(*entry.args)
        elif entry.kind == "unmap":
            if gpu_idle:
                entry.fn(*entry.args)
            else:
                self._left_mapped = True
                self.leaked.append(f"{entry.what} (left mapped: this GPU's work was not finished)")
        elif entry.kind == "barrier":
            if self._left_mapped:
                # Entering would tell the peers that their buffers are unmapped here, and they would free
                # them under copies this GPU may still run: stay out, so their barrier fails and they keep them.
                self._peers_clear = False
            if not self._peers_clear:
                return
            self._peers_clear = False  # until the barrier says otherwise (an interrupt leaves it False)
            self._peers_clear = bool(entry.fn(*entry.args))
        elif self._peers_clear and gpu_idle:
            entry.fn(*entry.args)
        else:
            if entry.on_leak is not None:
                entry.on_leak()
            self.leaked_nbytes += entry.nbytes
            self.leaked.append(f"{entry.what} ({entry.nbytes} bytes, kept: a peer may still map it)")

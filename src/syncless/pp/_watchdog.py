"""A host thread that turns a GPU flag wait that never ends into an error.

Why it exists: the copy-engine transport's waits run on the GPU
(``cuStreamWaitValue64``). If the peer dies after its metadata arrived but
before its GPU wrote the flag, the waiting stream would block forever, and so
would everything queued behind it (``torch.cuda.synchronize`` included).

How it works: each wait is bracketed by two events on its stream::

    stream:  ...earlier work... [pre] wait(flag >= N) ...copies, flag write... [post]
                                  ^ clock starts when pre completes (the GPU reached the wait),
                                    so a long kernel before the wait never counts as the peer's delay.

A send with depth >= 1 runs on a relay stream that waits for the peer's flag
first and for the caller's own work (on another stream) second, and its
bracket carries two more events::

    relay:   [pre] wait(flag >= N) [waited] wait(ready) ...copies, flag write... [post]
    caller:  ...caller's work... [ready]

The clock starts only once both ``pre`` and ``ready`` completed (the relay is
at the wait and the caller's work is done, so a receiver that is merely slower
than the caller is not counted), and stops for good once ``waited`` completed
(what is left is the caller's own work and the copies, not the peer's delay).

Every ``poll_s`` the thread looks at the oldest pending bracket of each
stream (a stream runs in order, so later brackets cannot finish first). When
its clock has run for longer than the timeout without reaching ``post`` (or
``waited``), the thread calls ``on_timeout``: the transport records the error
that its next call raises, and releases the waits from the host side (a write
of a large value into its own flags on a private stream, which no wait
blocks). Released steps deliver undefined data; the next call raises. It
fires once per stuck bracket, not once per transport: a peer that is alive
but late may write its flag after the release, over the release value, and a
later wait that blocks again is released in its turn after its own timeout
(so ``close()`` always ends).

The thread holds the transport only weakly (``on_timeout`` may be a
:class:`weakref.WeakMethod`): a transport dropped without ``close()`` is
collected, and the thread ends. A bracket counts as released only once
``on_timeout`` returned; if it raises, the error is logged and the call is
tried again at the next poll, and :meth:`Watchdog.wait_idle` has a deadline,
so a failing release can delay ``close()`` but never hang it.

Which hardware queue the release write goes through: the private stream's.
A blocked ``cuStreamWaitValue64`` holds the hardware queue its stream is
mapped to. Under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream of the
context shares one queue, and the release stayed queued behind the wait it
should release (measured on H200s): the host still raised on time, but the
GPU stayed blocked until the peer's flag came. So set-up refuses that
setting (``_eligibility.connections_problem``; ``docs/pp.md``, failure
model, says what is left with two or more queues).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from syncless.pp._driver import Event

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Bracket:
    """One watched wait: events before and after it on ``stream``.

    ``label.format(step)`` names it in the error; it is formatted only then, not on every step.
    ``ready`` and ``waited`` (optional, together): the caller's work before the step is done, and
    the flag wait is over (see the module docstring).
    """

    stream: int
    pre: Event
    post: Event
    label: str
    step: int = 0
    waited: Event | None = None
    ready: Event | None = None
    reached_at: float | None = None
    released: bool = False

    def what(self) -> str:
        return self.label.format(self.step)

    def events(self) -> tuple[Event, ...]:
        """The bracket's events, to hand back for reuse once it is finished."""
        return tuple(event for event in (self.pre, self.ready, self.waited, self.post) if event is not None)


class Watchdog:
    """Watches brackets on behalf of one transport; see the module docstring.

    Args:
        timeout_s: how long the GPU may sit in one wait.
        on_timeout: called on the watchdog thread, once per stuck bracket, with a description of it; or a
            :class:`weakref.WeakMethod` of such a method (the thread ends once its object is gone).
        recycle: called with each finished bracket's events (from the watchdog thread).
        bind_context: called first on the watchdog thread (makes the transport's CUDA context current).
    """

    def __init__(
        self,
        timeout_s: float,
        on_timeout: Callable[[str, float], None] | weakref.WeakMethod,
        recycle: Callable[[Event], None],
        bind_context: Callable[[], None],
    ):
        self.timeout_s = timeout_s
        self.poll_s = min(0.01, timeout_s / 20)
        self._on_timeout = on_timeout
        self._recycle = recycle
        self._bind_context = bind_context
        self._lanes: dict[int, deque[Bracket]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="syncless-pp-watchdog", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The watchdog's thread."""
        return self._thread

    def watch(self, bracket: Bracket) -> None:
        """Start watching ``bracket`` (its events must already be recorded)."""
        with self._lock:
            self._lanes.setdefault(bracket.stream, deque()).append(bracket)

    def pending(self) -> int:
        """Return how many brackets have not reached ``post`` yet (as of the last poll)."""
        with self._lock:
            return sum(len(lane) for lane in self._lanes.values())

    def wait_idle(self, deadline_s: float | None = None, poll_s: float = 0.002) -> bool:
        """Block the host until every bracket finished (stuck waits are released after the timeout).

        Returns True once idle, False if ``deadline_s`` (seconds from now; None: no deadline) passed first.
        When the thread is not running (stopped or dead) this polls itself.
        """
        end = None if deadline_s is None else time.monotonic() + deadline_s
        while self.pending():
            if end is not None and time.monotonic() > end:
                return False
            if not self._thread.is_alive():
                self._poll_once()
            time.sleep(poll_s)
        return True

    def stop(self, join: bool = True, timeout_s: float | None = None) -> None:
        """Stop the thread (wait for it, at most ``timeout_s``, unless ``join`` is False); twice is harmless.

        Brackets stay listed: :meth:`wait_idle` then polls them itself (their events are the
        transport's, destroyed with it).
        """
        self._stop.set()
        if not join:
            return
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self._bind_context()
            owner = self._on_timeout if isinstance(self._on_timeout, weakref.WeakMethod) else None
            while not self._stop.wait(self.poll_s):
                if (owner is not None and owner() is None) or not self._poll_once():
                    return  # the transport is gone (its finalizer releases what it held)
        except Exception:  # noqa: BLE001 - a dying watchdog must say so; wait_idle then polls itself
            logger.exception("syncless pp watchdog stopped")

    def _call_on_timeout(self, what: str, waited_s: float) -> bool:
        """Call ``on_timeout``; return False if its transport is gone. Its own error is logged, not raised."""
        target = self._on_timeout
        if isinstance(target, weakref.WeakMethod):
            target = target()
            if target is None:
                return False
        try:
            target(what, waited_s)
        except Exception:  # noqa: BLE001 - logged; the bracket stays unreleased, so the next poll tries again
            logger.exception("syncless pp watchdog: releasing %s failed; trying again", what)
            raise _ReleaseFailed from None
        return True

    def _poll_once(self) -> bool:
        """Look at the head of every lane once; return False if the transport is gone."""
        now = time.monotonic()
        with self._lock:
            heads = [(stream, lane) for stream, lane in self._lanes.items() if lane]
        for _stream, lane in heads:
            while True:
                with self._lock:
                    if not lane:
                        break
                    head = lane[0]
                if head.post.query():
                    with self._lock:
                        if not lane or lane[0] is not head:
                            break  # wait_idle() polling on another thread took it first
                        lane.popleft()
                    for event in head.events():
                        self._recycle(event)
                    continue
                if head.reached_at is None:
                    if head.pre.query() and (head.ready is None or head.ready.query()):
                        head.reached_at = now
                elif head.waited is not None and head.waited.query():
                    pass  # the flag wait is over; the stream now runs the caller's work
                elif now - head.reached_at > self.timeout_s and not head.released:
                    try:
                        if not self._call_on_timeout(head.what(), now - head.reached_at):
                            return False
                    except _ReleaseFailed:
                        break
                    head.released = True  # only once the release was enqueued
                break
        return True


class _ReleaseFailed(Exception):
    """``on_timeout`` raised (already logged)."""

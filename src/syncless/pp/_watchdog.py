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
"""

from __future__ import annotations

import logging
import threading
import time
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
        on_timeout: called on the watchdog thread, once per stuck bracket, with a description of it.
        recycle: called with each finished bracket's events (from the watchdog thread).
        bind_context: called first on the watchdog thread (makes the transport's CUDA context current).
    """

    def __init__(
        self,
        timeout_s: float,
        on_timeout: Callable[[str, float], None],
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

    def watch(self, bracket: Bracket) -> None:
        """Start watching ``bracket`` (its events must already be recorded)."""
        with self._lock:
            self._lanes.setdefault(bracket.stream, deque()).append(bracket)

    def pending(self) -> int:
        """Return how many brackets have not reached ``post`` yet (as of the last poll)."""
        with self._lock:
            return sum(len(lane) for lane in self._lanes.values())

    def wait_idle(self, poll_s: float = 0.002) -> None:
        """Block the host until every bracket finished; stuck waits are released after the timeout."""
        while self.pending():
            if not self._thread.is_alive():
                self._poll_once()
            time.sleep(poll_s)

    def stop(self) -> None:
        """Stop the thread and hand back the events of any bracket still listed."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            leftovers = [b for lane in self._lanes.values() for b in lane]
            self._lanes.clear()
        for bracket in leftovers:
            for event in bracket.events():
                self._recycle(event)

    def _run(self) -> None:
        try:
            self._bind_context()
            while not self._stop.wait(self.poll_s):
                self._poll_once()
        except Exception:  # noqa: BLE001 - a dying watchdog must say so; wait_idle then polls itself
            logger.exception("syncless pp watchdog stopped")

    def _poll_once(self) -> None:
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
                    head.released = True
                    self._on_timeout(head.what(), now - head.reached_at)
                break

"""An ordered worker thread (one per D2H stream): runs its jobs in submission order, keeps their errors.

Plain Python (no CUDA here): the D2H path submits closures that wait for the
D2H stream's ready event and copy. Sequence numbers let a synchronize wait for exactly the
jobs submitted before it, and collect the errors of exactly those jobs.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from syncless._core.errors import SynclessError

_log = logging.getLogger(__name__)


class D2HCopyError(SynclessError):
    """A device-to-host copy that the worker thread performed failed.

    Raised by the next call of the host thread that issued the copy that
    covers it (a synchronize, query or wait of an event, stream or the
    device; docs/cc.md, "Errors"), or by any thread's once that one has
    ended, and by ``uninstall()``. ``worker_traceback`` holds the worker thread's traceback text; the
    original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, worker_traceback: str):
        super().__init__(f"{message}\n--- worker traceback ---\n{worker_traceback}")
        self.worker_traceback = worker_traceback


class D2HTimeoutError(SynclessError, TimeoutError):
    """Queued device-to-host copies did not finish within a bounded wait (``uninstall()``)."""


# Failures of every worker that no covering call has raised yet (one integer the event record path reads).
UNRAISED = [0]
_unraised_lock = threading.Lock()


def _count_unraised(delta: int) -> None:
    with _unraised_lock:
        UNRAISED[0] += delta


@dataclass
class _Failure:
    seq: int
    error: BaseException
    text: str
    what: str
    thread: threading.Thread | None = None  # the host thread that submitted the job (None: unknown)
    raised_on: set = field(default_factory=set)  # the threads it was raised on (objects: idents are reused)

    def owned_here(self) -> bool:
        """Whether this thread raises it: the submitting thread, or any thread once that one has ended."""
        return self.thread is None or self.thread is threading.current_thread() or not self.thread.is_alive()


class OrderedWorker:
    """Run submitted callables on one daemon thread, in order.

    Args:
        name: thread name (each job is named in error messages by the ``what`` given to :meth:`submit`).
    """

    def __init__(self, name: str = "syncless-d2h") -> None:
        self._name = name
        self._cv = threading.Condition()
        self._jobs: collections.deque[tuple[int, Callable[[], None], str, threading.Thread]] = collections.deque()
        self._submitted = 0
        self._completed = 0
        self._failures: list[_Failure] = []  # in sequence order
        # Every job up to here has finished and none of their failures is still waiting to be raised.
        # Written under self._cv (see _settle); read without it by wait_and_raise's fast path.
        self._settled = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._atexit_registered = False

    # -- state ------------------------------------------------------------
    @property
    def submitted(self) -> int:
        """Sequence number of the last job submitted (0: none yet)."""
        return self._submitted

    @property
    def completed(self) -> int:
        """Every job up to this sequence number has finished (ran or failed)."""
        return self._completed

    def is_pending(self, upto: int) -> bool:
        """Return whether a job numbered ``<= upto`` has not finished."""
        return self._completed < upto

    @property
    def accepting(self) -> bool:
        """Whether :meth:`submit` takes jobs (False once :meth:`shutdown` began, until :meth:`restart`)."""
        return not self._stopping

    def is_worker_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    # -- submit / run ------------------------------------------------------
    def submit(self, job: Callable[[], None], what: str = "job") -> int:
        """Queue ``job``; return its sequence number. Never blocks on the job.

        Raises:
            RuntimeError: the worker has been shut down.
        """
        with self._cv:
            if self._stopping:
                raise RuntimeError(f"{self._name} worker has been shut down; no new copies are accepted")
            seq = self._submitted + 1
            self._submitted = seq
            self._jobs.append((seq, job, what, threading.current_thread()))
            self._ensure_thread()
            self._cv.notify_all()
            return seq

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()
        if not self._atexit_registered:
            atexit.register(self.shutdown, 10.0)
            self._atexit_registered = True

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                if not self._jobs:
                    return
                seq, job, what, submitter = self._jobs[0]
            try:
                job()
            except BaseException as err:  # noqa: BLE001 - every failure is kept and re-raised at a synchronize
                text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
                # The text keeps what the traceback says; its frames' locals (the snapshot, the pinned destination,
                # held by the wrappers the copy went through) are let go now rather than when the error is raised.
                traceback.clear_frames(err.__traceback__)
                failure = _Failure(seq, err, text, what, submitter)
            else:
                failure = None
            settled = getattr(job, "settled", None)  # called once the job's end is on record (see _d2h._counted)
            job = None  # the closure (and what it holds) goes now, not at the next job
            with self._cv:
                self._jobs.popleft()
                if failure is not None:
                    self._failures.append(failure)
                    _count_unraised(1)
                self._completed = seq
                self._settle()
                if settled is not None:
                    settled()
                self._cv.notify_all()

    def _settle(self) -> None:
        """Recompute ``_settled``; the caller holds ``self._cv``.

        It only grows: ``_completed`` only grows, a failure is appended only for the job that just completed
        (a number above the old ``_settled``) and failures are otherwise only removed.
        """
        self._settled = self._failures[0].seq - 1 if self._failures else self._completed

    # -- wait / errors -------------------------------------------------------
    def wait_for(self, seq: int, poll_s: float = 1.0, timeout_s: float | None = None) -> None:
        """Block the calling thread until every job up to ``seq`` has finished (at most ``timeout_s``).

        Must not be called from the worker thread itself (it would wait for
        itself); such a call returns at once.

        Raises:
            RuntimeError: the worker thread is gone while jobs are still queued.
            D2HTimeoutError: ``timeout_s`` passed first.
        """
        if self.is_worker_thread():
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._completed < seq:
                if deadline is not None and time.monotonic() >= deadline:
                    raise D2HTimeoutError(
                        f"{self._name}: copies up to #{seq} are unfinished after {timeout_s:g} s (finished up to "
                        f"#{self._completed}); the work they wait for on the GPU never finished"
                    )
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError(
                        f"{self._name} worker thread is not running but copies up to #{seq} are unfinished "
                        f"(finished up to #{self._completed}); was the interpreter shutting down?"
                    )
                self._cv.wait(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))

    def raise_errors(self, upto: int, *, any_thread: bool = False) -> None:
        """Raise :class:`D2HCopyError` for the first failed job numbered ``<= upto`` that this thread has not seen.

        Every thread whose covering call covers a failed copy gets it once (docs/cc.md, "errors"), as a CUDA
        error reaches every thread's synchronize: a consumer thread that synchronizes an event the issuing
        thread handed it must not read the unwritten buffer as if all were well. The failure is forgotten once
        the thread that submitted the copy has had it (or that thread has ended); ``any_thread``
        (``uninstall()``) raises and forgets every one.
        """
        me = threading.current_thread()
        with self._cv:
            if not self._failures:
                return
            covered = [f for f in self._failures if f.seq <= upto and (any_thread or me not in f.raised_on)]
            if not covered:
                return
            done = [f for f in covered if any_thread or f.owned_here()]
            for failure in covered:
                failure.raised_on.add(me)
            if done:
                self._failures = [f for f in self._failures if f not in done]
                _count_unraised(-len(done))
                self._settle()
        first = covered[0]
        more = f" ({len(covered) - 1} more failed copies were covered by this synchronize)" if len(covered) > 1 else ""
        raise D2HCopyError(
            f"{first.what} (#{first.seq}) failed in the syncless D2H worker: {type(first.error).__name__}: "
            f"{first.error}{more}",
            first.text,
        ) from first.error

    def wait_and_raise(self, seq: int, timeout_s: float | None = None, *, any_thread: bool = False) -> None:
        """:meth:`wait_for` then :meth:`raise_errors` up to ``seq``.

        Returns at once, without taking the lock, when nothing up to ``seq`` is left to wait for or to raise.
        """
        # Lock-free fast path. One read of one int, which is atomic (with or without the GIL). Its value was
        # stored under the lock when every job <= it had finished and no failure <= it was waiting; both stay
        # true (jobs do not un-finish; a failure is recorded only for a job that has just completed, numbered
        # above every _settled stored before). A stale read is only smaller: the slow path then decides. Jobs
        # submitted concurrently get numbers above ``seq`` (the caller read ``submitted`` before them), so
        # neither path waits for them. So seq <= _settled means the slow path would neither wait nor raise.
        if seq <= self._settled:
            return
        self.wait_for(seq, timeout_s=timeout_s)
        self.raise_errors(seq, any_thread=any_thread)

    def failures_pending(self) -> int:
        with self._cv:
            return len(self._failures)

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Finish queued jobs (at most ``timeout_s``), then stop; return whether it finished.

        Later :meth:`submit` calls raise. Safe to call more than once.
        """
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            _log.warning("%s worker still had %d copies queued after %.1f s at shutdown; abandoning them",
                         self._name, len(self._jobs), timeout_s)
            return False
        return True

    def restart(self) -> None:
        """Accept jobs again after :meth:`shutdown` (for tests and re-install)."""
        with self._cv:
            self._stopping = False

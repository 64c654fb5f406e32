"""An ordered queue of copy jobs (one per D2H stream): run in submission order, by whichever thread needs them first.

Plain Python (no CUDA here): the D2H path submits jobs that wait for the D2H
stream's ready event and copy. Sequence numbers let a synchronize wait for
exactly the jobs submitted before it, and collect the errors of exactly
those jobs.

Who runs a job. A thread that must wait for job ``#n`` anyway (a covering
synchronize, with no time limit) runs the jobs up to ``#n`` itself, one at a
time and in order, instead of waking a helper thread and sleeping until it
is done. In a decode loop that reads its tokens one step late, the copy has
been ready for a step by then, so the wait costs the transfer alone and no
hand-off of the GIL (a helper thread takes the GIL after every driver call,
and each take while the loop runs Python costs a switch, up to the 5 ms
switch interval). The queue's own thread (started at the first submit)
takes the rest:

- a job submitted ``eager`` (a large copy, whose transfer is worth
  overlapping with the host's work) at once;
- any job that nobody has waited for within :data:`GRACE_S` of its submit
  (so memory held by small copies is let go, and a program that only polls
  sees them land);
- everything, at once, after :meth:`OrderedWorker.kick` (a ``query()`` that
  found a copy pending) and during a bounded wait or a shutdown.

Failures are kept until :meth:`OrderedWorker.take_unreported` (``uninstall()``
and ``close_d2h_stream()``): each thread whose covering call covers one has
it raised once (a per-thread mark, so a thread that has had every failure
takes the fast path again), whichever thread issued the copy and in
whatever order the threads synchronize (docs/cc.md, "Errors").
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from syncless._core.errors import SynclessError

_log = logging.getLogger(__name__)

# How long a job that was not submitted eager may wait for a thread that needs it before the queue's own thread
# runs it (seconds). Short against anything a program would notice, long against a decode step.
GRACE_S = 0.02
# Failures kept per queue; beyond this the oldest are dropped (logged once): a program that ignores thousands of
# failed copies must not grow without bound.
MAX_KEPT_FAILURES = 1024


class D2HCopyError(SynclessError):
    """A device-to-host copy that syncless offloaded failed.

    Raised once on every host thread whose covering call covers the copy (a
    synchronize, query or wait of an event, stream or the device; docs/cc.md,
    "Errors"), and by ``uninstall()`` and ``close_d2h_stream()`` if the thread
    that issued it never had it. ``message`` is its headline, ``worker_traceback``
    the traceback text of the failed job; the original exception is chained as
    ``__cause__``.
    """

    def __init__(self, message: str, worker_traceback: str):
        super().__init__(f"{message}\n--- worker traceback ---\n{worker_traceback}")
        self.message = message
        self.worker_traceback = worker_traceback


class D2HTimeoutError(SynclessError, TimeoutError):
    """Queued device-to-host copies did not finish within a bounded wait (``uninstall()``)."""


# Failures kept by every queue (one integer the event record path reads: an event recorded while one is kept is
# stamped, so that a thread that has not had it yet gets it at that event's synchronize).
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
    issuer_had_it: bool = False  # raised on the submitting thread (uninstall() raises only those it never had)


def error_for(failures: list[_Failure]) -> D2HCopyError:
    """The :class:`D2HCopyError` that reports ``failures`` (the first in full, a count of the others)."""
    first = failures[0]
    more = f" ({len(failures) - 1} more failed copies were covered by this call)" if len(failures) > 1 else ""
    err = D2HCopyError(
        f"{first.what} (#{first.seq}) failed in the syncless D2H worker: {type(first.error).__name__}: "
        f"{first.error}{more}",
        first.text,
    )
    err.__cause__ = first.error
    err.__suppress_context__ = True
    return err


def forget_unraised_after_fork() -> None:
    """In a forked child: no failure is kept (the queues are forgotten with the parent's threads)."""
    global _unraised_lock
    _unraised_lock = threading.Lock()
    UNRAISED[0] = 0


class _Job:
    """One queued job: its number, the callable, how to name it, who submitted it, when the queue's thread may
    take it (``eager``: at once; else after its grace)."""

    __slots__ = ("seq", "run", "what", "submitter", "due", "eager")

    def __init__(self, seq, run, what, submitter, due, eager):
        self.seq, self.run, self.what, self.submitter, self.due, self.eager = seq, run, what, submitter, due, eager

    def describe(self) -> str:
        what = self.what
        if what is None:
            what = getattr(self.run, "describe", None) or "job"
        return what() if callable(what) else str(what)


class OrderedWorker:
    """Run submitted callables in order, on the thread that first needs them or on the queue's own thread.

    Args:
        name: thread name (each job is named in error messages by the ``what`` given to :meth:`submit`).
    """

    def __init__(self, name: str = "syncless-d2h") -> None:
        self._name = name
        self._make_conditions()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._submitted = 0
        self._completed = 0
        self._running = False  # some thread (the queue's, or a waiter) runs the head job now
        self._runner: threading.Thread | None = None  # that thread
        self._wake = False  # run everything queued now (kick(), a bounded wait, shutdown)
        self._idle = False  # the queue's thread sleeps with no deadline: a submit must wake it
        self._thread_awaits_end = False  # the queue's thread sleeps until the running job ends
        self._waiters = 0  # threads asleep in wait_for()
        self._failures: list[_Failure] = []  # in sequence order
        self._newest_failure = 0  # seq of the newest failure kept (0: none); read without the lock
        self._oldest_failure = 0  # and of the oldest
        self._seen = threading.local()  # per thread: .upto, every failure <= it has been raised on that thread
        self._thread: threading.Thread | None = None
        self._thread_runs = False  # the queue's thread is in its loop (cleared as it leaves it, even by an error)
        self._stopping = False
        self._atexit_registered = False
        self._dropped_logged = False

    def _make_conditions(self) -> None:
        # Two conditions on one lock: ``_cv`` for threads in wait_for(), ``_thread_cv`` for the queue's own thread.
        # A job's end wakes only who needs it: waking the queue's thread at every end (one Condition for both)
        # made it take the GIL twice per job, each time the decode loop was running Python (issue 33: ~2 takes
        # per step, and every phase of the step slowed down).
        # An RLock, taken once at a time, so that _run_head can tell after an interrupt whether this thread holds
        # it (``_is_owned``). Every block takes it with ``with self._lock:``, whose take is the lock's own C method:
        # a Condition's ``__enter__`` is Python code, and an interrupt raised as its take returned left the lock
        # held with no ``__exit__`` to come.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._thread_cv = threading.Condition(self._lock)

    def _wake_thread(self) -> None:
        """Wake the queue's thread (the caller holds the lock)."""
        self._thread_cv.notify()

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
    def newest_failure(self) -> int:
        """Number of the newest failed job kept (0: none); read without the lock."""
        return self._newest_failure

    @property
    def accepting(self) -> bool:
        """Whether :meth:`submit` takes jobs (False once :meth:`shutdown` began, until :meth:`restart`)."""
        return not self._stopping

    def is_worker_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    # -- submit / run ------------------------------------------------------
    def submit(self, job: Callable[[], None], what: str | Callable[[], str] | None = None, *,
               eager: bool = True) -> int:
        """Queue ``job``; return its sequence number. Never blocks on the job.

        ``what`` names it in an error (a string, or a function that makes one, called only on failure; None: the
        job's own ``describe``). ``eager``: the queue's thread runs it as soon as it can; otherwise it waits up to
        :data:`GRACE_S` for a thread that needs it (:meth:`wait_for`), and submitting wakes no thread.

        Raises:
            RuntimeError: the worker has been shut down.
        """
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"{self._name} worker has been shut down; no new copies are accepted")
            seq = self._submitted + 1
            entry = _Job(seq, job, what, threading.current_thread(), time.monotonic() + GRACE_S, eager)
            # Counted and queued with no call between (an interrupt comes out of a call as it returns): whatever
            # interrupts this method, ``_submitted`` says whether the job is queued (_d2h._submit_locked reads it;
            # the first submit's Thread.start() below waits, and a KeyboardInterrupt there left the job queued while
            # the offload took it for never submitted: its pending count ended at -1).
            self._submitted = seq
            self._jobs.append(entry)
            if not self._thread_runs:  # (a flag, not Thread.is_alive(): two Python calls fewer per copy)
                self._start_thread()
            elif eager or self._idle:
                self._wake_thread()
            return seq

    def kick(self) -> None:
        """Have the queue's thread run every queued job now (a poller found one pending). Does not block."""
        with self._lock:
            if self._jobs and not self._wake:
                self._wake = True
                self._wake_thread()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run_loop, name=self._name, daemon=True)
        self._thread_runs = True  # (the caller holds the lock, which the new thread's loop takes first)
        self._thread.start()
        if not self._atexit_registered:
            atexit.register(self.shutdown, 10.0)
            self._atexit_registered = True

    def _may_take(self, now: float) -> bool:
        """Whether the queue's own thread takes the head job now (the caller holds the lock)."""
        head = self._jobs[0]
        return head.eager or self._wake or self._stopping or now >= head.due

    def _run_loop(self) -> None:
        try:
            self._loop()
        finally:
            self._thread_runs = False  # the next submit starts a new thread

    def _loop(self) -> None:
        submitted_at_last_sleep = -1
        with self._lock:
            while True:
                if self._jobs and not self._running and self._may_take(time.monotonic()):
                    self._run_head()
                    continue
                if not self._jobs:
                    self._wake = False
                    if self._stopping:
                        return
                timeout = None
                if self._running:
                    self._thread_awaits_end = True  # whoever runs it wakes this thread at its end
                elif self._jobs:
                    timeout = max(0.0, self._jobs[0].due - time.monotonic())
                elif self._submitted != submitted_at_last_sleep:
                    timeout = GRACE_S  # jobs came and went: look again once before going idle
                submitted_at_last_sleep = self._submitted
                self._idle = timeout is None and not self._running
                self._thread_cv.wait(timeout)
                self._idle = self._thread_awaits_end = False

    def _run_head(self) -> None:
        """Run the head job on this thread and record its end (the caller holds the lock; it is released meanwhile).

        A ``KeyboardInterrupt`` (or other non-``Exception``) reaching a thread that runs a job it was waiting for
        puts the job back at the head and is raised on: every job is safe to run again from its start (it waits,
        copies and waits again), and the user's interrupt must not become a copy failure. On the queue's own
        thread every exception is the job's failure. An interrupt that comes once the job has ended (returned or
        failed), as its end is recorded, leaves it recorded as ended, its failure kept: a job lets go of what it
        holds as it fails, so run again it would pass as a success.
        """
        job = self._jobs[0]  # (popped below: an interrupt as popleft() returned would lose it)
        ended = False  # set as the job returns or fails, and never cleared
        error = failure = None
        settled = None
        settling = False  # set before settled() is called: a count left one too high only slows the hot paths
        try:
            self._jobs.popleft()
            self._running = True
            self._runner = threading.current_thread()
            self._cv.release()
            try:
                job.run()
            except Exception as err:  # noqa: BLE001 - every failure is kept and raised at a covering call
                ended, error = True, err
                failure = self._failure_of(job, err)
            except BaseException as err:
                if not self.is_worker_thread():
                    raise
                ended, error = True, err
                failure = self._failure_of(job, err)
            ended = True
            settled = getattr(job.run, "settled", None)  # called once the job's end is on record (see _d2h)
            job.run = None  # the job (and what it holds) goes now, not at the next one
            self._cv.acquire()
            if failure is not None:
                self._keep(failure)
            self._completed = job.seq
            self._running = False
            self._runner = None
            if settled is not None:
                settling = True
                settled()
            if self._waiters:
                self._cv.notify_all()
            if self._thread_awaits_end:
                self._wake_thread()
        except BaseException:
            if not self._lock._is_owned():
                self._cv.acquire()
            self._running = False
            self._runner = None
            if not ended:
                if not (self._jobs and self._jobs[0] is job):
                    self._jobs.appendleft(job)
            elif self._completed < job.seq:
                if error is not None:
                    if failure is None:  # the interrupt came as the failure was written
                        failure = _Failure(job.seq, error, "(no traceback: an interrupt came as it was written)",
                                           "offloaded copy", job.submitter)
                    if not any(kept is failure for kept in self._failures):  # (kept, then interrupted)
                        self._keep(failure)
                self._completed = job.seq
                if settled is None and job.run is not None:
                    settled = getattr(job.run, "settled", None)
                job.run = None
                if settled is not None and not settling:
                    settling = True
                    settled()
            elif settled is not None and not settling:
                settling = True
                settled()
            self._wake = True
            self._cv.notify_all()
            self._wake_thread()
            raise

    def _failure_of(self, job: _Job, err: BaseException) -> _Failure:
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        # The text keeps what the traceback says; its frames' locals (the snapshot, the pinned destination) are let
        # go now rather than when the error is raised.
        traceback.clear_frames(err.__traceback__)
        return _Failure(job.seq, err, text, job.describe(), job.submitter)

    def _keep(self, failure: _Failure) -> None:
        """Record ``failure`` (the caller holds the lock); drop the oldest past :data:`MAX_KEPT_FAILURES`."""
        self._failures.append(failure)
        self._newest_failure = failure.seq
        _count_unraised(1)
        if len(self._failures) > MAX_KEPT_FAILURES:
            del self._failures[0]
            _count_unraised(-1)
            if not self._dropped_logged:
                self._dropped_logged = True
                _log.warning("%s: more than %d offloaded copies failed; the oldest failures are dropped unraised",
                             self._name, MAX_KEPT_FAILURES)
        self._oldest_failure = self._failures[0].seq

    # -- wait / errors -------------------------------------------------------
    def wait_for(self, seq: int, poll_s: float = 1.0, timeout_s: float | None = None) -> None:
        """Block the calling thread until every job up to ``seq`` has finished (at most ``timeout_s``).

        With no ``timeout_s`` the calling thread runs the queued jobs up to
        ``seq`` itself while no other thread runs one (a job's own waits are
        on the GPU work it reads, which is enqueued already, so this cannot
        wait for the caller). With a ``timeout_s`` it only waits, and the
        queue's thread runs them, so the time limit holds even for a job
        whose GPU work never finishes. Must not be called from a job (it
        would wait for itself); such a call returns at once.

        Raises:
            RuntimeError: the queue's thread is gone while jobs are still queued (bounded wait only).
            D2HTimeoutError: ``timeout_s`` passed first.
        """
        if self.is_worker_thread() or self._runner is threading.current_thread():
            return
        helping = timeout_s is None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._completed < seq:
                if helping and not self._running and self._jobs and self._jobs[0].seq <= seq:
                    self._run_head()
                    continue
                if not helping:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise D2HTimeoutError(
                            f"{self._name}: copies up to #{seq} are unfinished after {timeout_s:g} s (finished up "
                            f"to #{self._completed}); the work they wait for on the GPU never finished"
                        )
                    if self._thread is None or not self._thread.is_alive():
                        raise RuntimeError(
                            f"{self._name} worker thread is not running but copies up to #{seq} are unfinished "
                            f"(finished up to #{self._completed}); was the interpreter shutting down?"
                        )
                    if not self._wake:
                        self._wake = True
                        self._wake_thread()
                wait_s = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
                self._waiters += 1
                try:
                    self._cv.wait(wait_s)
                finally:
                    self._waiters -= 1

    def _seen_upto(self) -> int:
        return getattr(self._seen, "upto", 0)

    def raise_errors(self, upto: int, *, any_thread: bool = False) -> None:
        """Raise :class:`D2HCopyError` for the first failed job numbered ``<= upto`` that this thread has not had.

        Every thread whose covering call covers a failed copy gets it once (docs/cc.md, "errors"), as a CUDA
        error reaches every thread's synchronize: a consumer thread that synchronizes an event the issuing thread
        handed it must not read the unwritten buffer as if all were well, whether or not the issuing thread
        synchronized first. ``any_thread`` (``uninstall()``, ``close_d2h_stream()``): raise every failure whose
        issuing thread never had it, and forget them all (:meth:`take_unreported`).
        """
        if any_thread:
            covered = self.take_unreported(upto)
        else:
            me = threading.current_thread()
            seen = self._seen_upto()
            with self._lock:
                covered = [f for f in self._failures if seen < f.seq <= upto]
                for failure in covered:
                    if failure.thread is me:
                        failure.issuer_had_it = True
                self._seen.upto = max(seen, min(upto, self._completed))
        if covered:
            raise self.error_for(covered)

    def error_for(self, failures: list[_Failure]) -> D2HCopyError:
        return error_for(failures)

    def failure_of(self, seq: int) -> D2HCopyError | None:
        """The error of job ``seq`` if it failed (kept), else None; marks nothing as raised."""
        with self._lock:
            for failure in self._failures:
                if failure.seq == seq:
                    return self.error_for([failure])
        return None

    def claim_failure(self, seq: int) -> D2HCopyError | None:
        """The error to raise for failed job ``seq`` on this thread, if this thread has not had it yet (with the
        failures numbered before it that it has not had either); it then has them, as after :meth:`raise_errors`
        (a staged upload of the memory the job was to write raises it: docs/cc.md). None: the job did not fail,
        its failure is forgotten, or this thread had it."""
        me = threading.current_thread()
        seen = self._seen_upto()
        with self._lock:
            failure = next((f for f in self._failures if f.seq == seq), None)
            if failure is None or seq <= seen:
                return None
            covered = [f for f in self._failures if seen < f.seq <= seq]
            for each in covered:
                if each.thread is me:
                    each.issuer_had_it = True
            self._seen.upto = max(seen, min(seq, self._completed))
        return self.error_for(covered)

    def take_unreported(self, upto: int | None = None) -> list[_Failure]:
        """Forget every kept failure (up to ``upto``); return those whose issuing thread never had them."""
        with self._lock:
            taken = [f for f in self._failures if upto is None or f.seq <= upto]
            if not taken:
                return []
            self._failures = [f for f in self._failures if f not in taken]
            self._newest_failure = self._failures[-1].seq if self._failures else 0
            self._oldest_failure = self._failures[0].seq if self._failures else 0
            _count_unraised(-len(taken))
        return [f for f in taken if not f.issuer_had_it]

    def wait_and_raise(self, seq: int, timeout_s: float | None = None, *, any_thread: bool = False) -> None:
        """:meth:`wait_for` then :meth:`raise_errors` up to ``seq``.

        Returns at once, without taking the lock, when nothing up to ``seq`` is left to wait for or to raise on
        this thread.
        """
        # Lock-free fast path: two int reads (atomic with or without the GIL), in this order. A failure is kept
        # before its job is counted complete, so a reader that sees ``_completed`` at or past ``seq`` also sees
        # every failure numbered <= seq in ``_newest_failure``; one newer than this thread's mark sends it down the
        # slow path, which decides. Jobs submitted concurrently get numbers above ``seq``.
        if not any_thread and seq <= self._completed and (
                not self._newest_failure or seq < self._oldest_failure or self._newest_failure <= self._seen_upto()):
            return
        self.wait_for(seq, timeout_s=timeout_s)
        if not any_thread and not self._newest_failure:
            # Every job up to seq has finished, and a failure is kept before its job counts as finished: none
            # of them failed (or their failures were taken by uninstall/close), so there is nothing to raise or mark.
            return
        self.raise_errors(seq, any_thread=any_thread)

    def failures_pending(self) -> int:
        """How many kept failures the thread that issued them has not had yet (what ``uninstall()`` would raise)."""
        with self._lock:
            return sum(1 for f in self._failures if not f.issuer_had_it)

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Finish queued jobs (at most ``timeout_s``), then stop; return whether it finished.

        Later :meth:`submit` calls raise. Safe to call more than once.
        """
        with self._lock:
            self._stopping = True
            self._cv.notify_all()
            self._wake_thread()
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
        with self._lock:
            self._stopping = False

    def forget_after_fork(self, keep: list) -> None:
        """In a forked child: forget everything (its thread does not exist there; its lock may be held).

        The queued jobs go into ``keep``, never freed: they hold CUDA memory and events, and releasing those in
        a forked child calls into CUDA, which aborts the process there (a DataLoader worker, on the H200).
        """
        self._make_conditions()
        keep.append(list(self._jobs))
        self._jobs.clear()
        self._completed = self._submitted
        self._running = self._wake = self._idle = self._thread_awaits_end = False
        self._waiters = 0
        self._thread_runs = False
        keep.append(self._failures)
        self._failures = []
        self._newest_failure = self._oldest_failure = 0
        self._thread = None

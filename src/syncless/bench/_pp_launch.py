"""Start the two ``syncless bench pp`` workers, relay their progress, collect their results.

The parent never touches CUDA here. It spawns one process per GPU, reads the
queue they post to, and stops them (terminate, then kill) when both are
done, when one fails, when the run exceeds its hard time limit, or when no
message came for the idle limit. Whatever results arrived before a failure
are kept, so a run that breaks late still reports what it measured.
"""

from __future__ import annotations

import queue as queue_module
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from syncless._core.launch import free_port
from syncless.bench._pp_plan import Plan

FINISHED = "finished"
WORLD_SIZE = 2
EXIT_GRACE_S = 30.0  # after both are done: time allowed for a clean tear-down
KILL_GRACE_S = 5.0


def set_path(tree: dict[Any, Any], path: Sequence[Any], value: Any) -> None:
    """Store ``value`` at ``path`` in nested dicts; a dict value is merged into a dict already there.

    Raises:
        ValueError: ``path`` is empty, or passes through a value that is not a dict.
    """
    if not path:
        raise ValueError("a result path needs at least one key; got an empty path")
    node = tree
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"result path {list(path)} passes through {key!r}, which holds a {type(child).__name__}")
        node = child
    leaf = path[-1]
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        node[leaf].update(value)
    else:
        node[leaf] = value


@dataclass
class Outcome:
    """What the workers delivered.

    Attributes:
        results: nested results posted by both ranks.
        notes: notes posted by the workers.
        complete: both ranks finished every section.
        failure: why the run stopped early (None if complete).
        errors: each failed rank's traceback text.
    """

    results: dict[Any, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    complete: bool = False
    failure: str | None = None
    errors: dict[int, str] = field(default_factory=dict)


class Collector:
    """Turns worker messages into an :class:`Outcome` and decides when to stop (plain logic, no processes)."""

    def __init__(self, progress: Callable[[str], None], hard_timeout_s: float, idle_timeout_s: float, start_s: float):
        self.progress = progress
        self.hard_timeout_s = hard_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.start_s = start_s
        self.last_message_s = start_s
        self.last_progress: dict[int, str] = {}
        self.done: set[int] = set()
        self.outcome = Outcome()

    def handle(self, message: tuple[Any, ...], now_s: float) -> None:
        """Apply one worker message (see :class:`~._pp_rig.Reporter`)."""
        self.last_message_s = now_s
        kind, rank = message[0], int(message[1])
        if kind == "progress":
            self.last_progress[rank] = message[2]
            self.progress(f"rank {rank}: {message[2]}")
        elif kind == "result":
            set_path(self.outcome.results, message[2], message[3])
        elif kind == "note":
            self.outcome.notes.append(message[2])
            self.progress(f"rank {rank}: note: {message[2]}")
        elif kind == "done":
            self.done.add(rank)
        elif kind == "error":
            self.outcome.errors[rank] = message[2]
            self.progress(f"rank {rank} failed:\n{message[2]}")
        else:
            raise ValueError(f"unknown worker message kind {kind!r}; expected progress, result, note, done or error")

    def verdict(self, now_s: float, exitcodes: Sequence[int | None]) -> str | None:
        """Return None to keep waiting, :data:`FINISHED`, or why the run must stop now."""
        if len(self.done) == len(exitcodes):
            return FINISHED
        if self.outcome.errors:
            rank = min(self.outcome.errors)
            lines = self.outcome.errors[rank].strip().splitlines()
            return f"rank {rank} failed: {lines[-1] if lines else 'no traceback'}"
        for rank, code in enumerate(exitcodes):
            if code is not None and rank not in self.done:
                return f"rank {rank} exited with status {code} before finishing{self._where()}"
        if now_s - self.start_s > self.hard_timeout_s:
            return f"hard time limit of {self.hard_timeout_s:.0f} s reached{self._where()}"
        if now_s - self.last_message_s > self.idle_timeout_s:
            return f"no message from either worker for {self.idle_timeout_s:.0f} s{self._where()}"
        return None

    def _where(self) -> str:
        if not self.last_progress:
            return " (before any progress)"
        parts = [f"rank {rank} last said {text!r}" for rank, text in sorted(self.last_progress.items())]
        return " (" + "; ".join(parts) + ")"

    def finish(self, verdict: str) -> Outcome:
        self.outcome.complete = verdict == FINISHED
        self.outcome.failure = None if self.outcome.complete else verdict
        return self.outcome


def _drain(source: Any, collector: Collector, wait_s: float) -> None:
    try:
        message = source.get(timeout=wait_s)
    except queue_module.Empty:
        return
    collector.handle(message, time.monotonic())
    while True:
        try:
            message = source.get_nowait()
        except queue_module.Empty:
            return
        collector.handle(message, time.monotonic())


def launch(plan: Plan, progress: Callable[[str], None]) -> Outcome:
    """Run both workers to the end (or to a failure or time limit); return what they delivered.

    Blocks the host for the whole benchmark, at most ``plan.hard_timeout_s``
    plus the shutdown grace.
    """
    import multiprocessing

    from syncless.bench._pp_worker import child_main

    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    port = free_port()
    workers = [
        context.Process(target=child_main, args=(rank, port, plan, messages), name=f"syncless-bench-pp-rank{rank}")
        for rank in range(WORLD_SIZE)
    ]
    start_s = time.monotonic()
    collector = Collector(progress, plan.hard_timeout_s, plan.idle_timeout_s, start_s)
    progress(f"starting {WORLD_SIZE} workers (one per GPU), store on 127.0.0.1:{port}")
    verdict: str | None = None
    try:
        for worker in workers:
            worker.start()
        while verdict is None:
            _drain(messages, collector, 0.5)
            verdict = collector.verdict(time.monotonic(), [worker.exitcode for worker in workers])
    finally:
        _stop(workers, messages, collector, EXIT_GRACE_S if verdict == FINISHED else 2.0)
    if verdict != FINISHED:
        progress(f"stopped early: {verdict}")
    return collector.finish(verdict)


def _stop(workers: list[Any], messages: Any, collector: Collector, grace_s: float) -> None:
    """Let the workers exit within ``grace_s`` (reading their last messages), then terminate, then kill."""
    deadline = time.monotonic() + grace_s
    while any(worker.is_alive() for worker in workers) and time.monotonic() < deadline:
        _drain(messages, collector, 0.2)
    for worker in workers:
        if worker.is_alive():
            collector.progress(f"stopping {worker.name} (pid {worker.pid})")
            worker.terminate()
    for worker in workers:
        worker.join(KILL_GRACE_S)
        if worker.is_alive():
            worker.kill()
            worker.join(KILL_GRACE_S)
    _drain(messages, collector, 0.0)

"""Violations: where they happened in the user's code, what to do, and the record.

A violation names the operation, the user's own file:line (frames of
syncless, of torch and of the warnings machinery are skipped) and the fix.
Every violation is recorded (a count and the first stack per call site), in
every mode; ``record`` mode only records, ``warn`` also warns, ``error``
also raises :class:`~syncless._core.errors.SyncViolation`.
"""

from __future__ import annotations

import atexit
import linecache
import os
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from types import FrameType

import syncless
from syncless._core.errors import SyncViolation
from syncless.syncs._state import settings


class SyncWarning(UserWarning):
    """Issued in ``warn`` mode for a hidden GPU sync in a checked region."""


KIND_EXPLICIT = "explicit"
KIND_IMPLICIT = "implicit copy"
KIND_WAIT = "host wait"

FIX_EXPLICIT = (
    "keep the value on the GPU (torch.where or masks instead of branching on tensor values in Python, "
    "nonzero_static or precomputed indices instead of nonzero and boolean masks), read results back with a "
    "non_blocking copy into pinned memory and an event, or move this call out of the hot region; if the sync "
    "is intended, wrap it in `with syncless.syncs.allowed():`"
)
FIX_WAIT = (
    "do not block the host in the hot loop: order GPU work with stream.wait_event()/wait_stream(), poll "
    "event.query(), or read results a step later; if the wait is intended, wrap it in "
    "`with syncless.syncs.allowed():`"
)

_SYNCLESS_DIR = os.path.dirname(os.path.abspath(syncless.__file__)) + os.sep

def _module_files(*names: str) -> frozenset[str]:
    files = set()
    for name in names:
        try:
            module = __import__(name)
        except ImportError:  # _py_warnings exists from Python 3.14 on
            continue
        if getattr(module, "__file__", None):
            files.add(os.path.abspath(module.__file__))
    return frozenset(files)


# The warnings machinery and context-manager plumbing sit between a sync and the user's frame.
_STDLIB_SKIP = _module_files("warnings", "_py_warnings", "contextlib")

# Frames of torch code that synchronizes by design at compile time (dynamo
# tracing, inductor lowering and autotuning, CUDA graph trees recording):
# a sync under one of them is not the user's hot loop.
_COMPILE_TIME_FILES = (
    "_dynamo/convert_frame.py",
    "_inductor/compile_fx.py",
    "_inductor/select_algorithm.py",
    "_inductor/autotune_process.py",
    "_inductor/runtime/triton_heuristics.py",
    "_inductor/runtime/benchmarking.py",
    "_inductor/cudagraph_trees.py",
    "_inductor/codecache.py",
    "_inductor/async_compile.py",
)
_COMPILE_TIME_SUFFIXES = tuple(part.replace("/", os.sep) for part in _COMPILE_TIME_FILES)


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch, "__file__", None) is None:
        return None
    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


@dataclass
class Violation:
    """One hidden sync in a checked region.

    Attributes:
        kind: ``explicit`` (torch's debug mode saw it), ``implicit copy``
            (a non_blocking copy that blocks anyway) or ``host wait``.
        operation: what synchronized, in words.
        filename, lineno, function: the user's own frame that made the call.
        fix: what to do about it.
        stack: the user's stack, outermost first, formatted (empty for a repeat of a call site already
            in the record, except in ``error`` mode, where the violation goes out with the exception).
        thread: name of the thread it happened on.
    """

    kind: str
    operation: str
    filename: str
    lineno: int
    function: str
    fix: str
    stack: str
    thread: str

    @property
    def site(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def message(self) -> str:
        return (
            f"hidden GPU sync in a checked region at {self.site} (in {self.function}): {self.operation} "
            f"[{self.kind}]. The host waits for the GPU here. Fix: {self.fix}."
        )


def _user_frame(start: FrameType | None) -> tuple[FrameType | None, bool]:
    """Walk outwards from ``start`` to the first frame of the user's code.

    Returns:
        (frame, compile_time): the user's frame (the outermost one seen if
        every frame belongs to syncless/torch), and whether a compile-time
        torch frame lies between the sync and the user's code.
    """
    torch_dir = _torch_dir()
    frame = start
    last = None
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename) if not frame.f_code.co_filename.startswith("<") else frame.f_code.co_filename
        last = frame
        if torch_dir is not None and filename.startswith(torch_dir):
            if filename.endswith(_COMPILE_TIME_SUFFIXES):
                return frame, True
        elif not (filename.startswith(_SYNCLESS_DIR) or filename in _STDLIB_SKIP or filename.startswith("<frozen")):
            return frame, False
        frame = frame.f_back
    return last, False


def locate(kind: str, operation: str | None, fix: str, start: FrameType | None) -> Violation | None:
    """Build a :class:`Violation` for a sync seen at ``start`` (a frame inside the call).

    Returns None when the sync comes from compile-time work (see
    ``_COMPILE_TIME_FILES``), which synchronizes by design.
    """
    frame, compile_time = _user_frame(start)
    if compile_time:
        return None
    if frame is None:
        return Violation(kind, operation or "a synchronizing CUDA operation", "<unknown>", 0, "<unknown>", fix, "", threading.current_thread().name)
    filename = frame.f_code.co_filename
    lineno = frame.f_lineno
    if operation is None:
        source = linecache.getline(filename, lineno).strip()
        operation = f"`{source}` called a synchronizing CUDA operation" if source else "a synchronizing CUDA operation"
    if settings.mode != "error" and recorder.knows(filename, lineno, operation):
        stack = ""  # a repeat: the record keeps the first one's stack, and only error mode hands this one out
    else:
        frames = [e for e in traceback.extract_stack(frame, limit=24) if not e.filename.startswith(_SYNCLESS_DIR)]
        stack = "".join(traceback.format_list(frames[-16:]))
    return Violation(kind, operation, filename, lineno, frame.f_code.co_name, fix, stack, threading.current_thread().name)


def _short(filename: str) -> str:
    """``filename`` relative to the working directory when it lies below it."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if relative.startswith("..") else relative


@dataclass
class SyncSite:
    """One call site in the record: how often it synchronized, and its first occurrence."""

    first: Violation
    count: int = 1

    @property
    def site(self) -> str:
        return self.first.site


@dataclass
class SyncReport:
    """Every call site recorded since the last :func:`reset`, most frequent first."""

    sites: list[SyncSite] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(site.count for site in self.sites)

    def __bool__(self) -> bool:
        return bool(self.sites)

    def format(self, stacks: bool = True) -> str:
        """Render the table of call sites (count, site, operation) and one stack per site."""
        if not self.sites:
            return "syncless: no hidden GPU syncs recorded"
        lines = [f"syncless: {self.total} hidden GPU sync(s) at {len(self.sites)} call site(s)"]
        names = [_short(s.first.filename) + f":{s.first.lineno}" for s in self.sites]
        width = max(len(name) for name in names)
        lines.append(f"{'count':>7}  {'site':<{width}}  kind           operation")
        for s, name in zip(self.sites, names):
            lines.append(f"{s.count:>7}  {name:<{width}}  {s.first.kind:<13}  {s.first.operation}")
        if stacks:
            for s in self.sites:
                lines.append("")
                lines.append(f"--- {s.site} in {s.first.function} ({s.count}x, first on thread {s.first.thread}) ---")
                lines.append(s.first.stack.rstrip())
                lines.append(f"fix: {s.first.fix}")
        return "\n".join(lines)


class _Recorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sites: dict[tuple[str, int, str], SyncSite] = {}
        self._atexit_registered = False

    def knows(self, filename: str, lineno: int, operation: str) -> bool:
        """Whether this call site and operation are in the record with a stack (no lock: a dict lookup)."""
        site = self._sites.get((filename, lineno, operation))
        return site is not None and bool(site.first.stack)

    def add(self, violation: Violation) -> None:
        key = (violation.filename, violation.lineno, violation.operation)
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                self._sites[key] = SyncSite(violation)
            else:
                site.count += 1
                if not site.first.stack and violation.stack:
                    # The site was recorded from a repeat without its stack (a reset() came between
                    # locate() and add() on another thread): keep this one's instead.
                    site.first = violation

    def report(self) -> SyncReport:
        with self._lock:
            sites = sorted(self._sites.values(), key=lambda s: (-s.count, s.site))
        return SyncReport(sites)

    def reset(self) -> None:
        with self._lock:
            self._sites.clear()

    def print_at_exit(self) -> None:
        """Arrange for the record to be printed (to stderr) when the process exits."""
        with self._lock:
            if self._atexit_registered:
                return
            self._atexit_registered = True
        atexit.register(self._print_if_any)

    def _print_if_any(self) -> None:
        report = self.report()
        if report:
            print(report.format(), file=sys.stderr)


recorder = _Recorder()


def handle(violation: Violation, forward_warning=None) -> None:
    """Record ``violation`` and act on it in the current mode.

    Args:
        forward_warning: in ``warn`` mode, a ``showwarning``-style callable to
            deliver the warning to directly; used by the warnings hook, which
            must not re-enter the warnings machinery. Without it, the warning
            goes through ``warnings.warn_explicit`` (and its filters).

    Raises:
        SyncViolation: in ``error`` mode.
    """
    recorder.add(violation)
    mode = settings.mode
    if mode == "error":
        err = SyncViolation(violation.message())
        err.violation = violation
        raise err
    if mode == "warn":
        text = violation.message()
        if forward_warning is not None:
            forward_warning(SyncWarning(text), SyncWarning, violation.filename, violation.lineno)
        else:
            warnings.warn_explicit(text, SyncWarning, violation.filename, violation.lineno, registry=None)

"""torch's CUDA sync debug mode, armed while any checked region is active.

torch's debug mode is one process-wide integer (0 off, 1 warn, 2 error).
The detector arms it at "warn" while at least one checked region is active
on any thread, and puts back whatever was there before when the last one
leaves (unless the user set a level in the meantime). The warnings it
produces are sorted per thread by the showwarning hook (:mod:`._hook`),
which is why torch's own "error" level cannot be used: it would raise on
every thread. A user's "error" level is honoured by the hook instead: a sync
outside a region raises torch's ``RuntimeError``, after the sync (torch
raises before it). While armed, ``torch.cuda.get_sync_debug_mode()`` reads 1
on every thread.

A CPU-only torch build has no debug mode (``torch._C._cuda_set_sync_debug_mode``
is absent); :class:`FakeDebugMode` stands in for it in tests, so the
detector's logic runs on the CPU (it fakes the hardware, never the logic).
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from collections.abc import Iterator

LEVEL_OFF = 0
LEVEL_WARN = 1
LEVEL_ERROR = 2


# A warnings filter entry (action, message, category, module, lineno) for torch's notice when the mode is set.
_QUIET_PROTOTYPE = ("ignore", re.compile("Synchronization debug mode is a prototype feature", re.I), Warning, None, 0)


class TorchDebugMode:
    """The real thing: ``torch._C._cuda_{get,set}_sync_debug_mode``."""

    def unavailable_reason(self) -> str | None:
        """Return why there is nothing to check here, or None if there is."""
        import torch

        if not hasattr(torch._C, "_cuda_set_sync_debug_mode"):
            return f"this torch build ({torch.__version__}) has no CUDA sync debug mode (CPU-only build)"
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible to torch"
        return None

    def __init__(self) -> None:
        self._get = None
        self._set = None

    def _bind(self) -> None:
        import torch

        self._get = torch._C._cuda_get_sync_debug_mode
        self._set = torch._C._cuda_set_sync_debug_mode

    def get(self) -> int:
        if self._get is None:
            self._bind()
        return int(self._get())

    def set(self, level: int) -> None:
        if self._set is None:
            self._bind()
        # torch warns "Synchronization debug mode is a prototype feature ..." when the mode is set; the
        # detector sets it, not the user, so the user's code must not see that warning (it changed what a
        # call warns with and without syncless, seen on an H200 by the signature test). Not catch_warnings:
        # its exit resets every warning registry (a once-per-line warning of the user's hot loop then
        # repeats every step) and puts back the whole filter list (undoing another thread's filters). One
        # entry in front, taken out again, is seen by this call only: an "ignore" entry writes no registry.
        filters = warnings.filters
        filters.insert(0, _QUIET_PROTOTYPE)
        try:
            self._set(level)
        finally:
            try:
                filters.remove(_QUIET_PROTOTYPE)
            except ValueError:  # another thread's filter change took it out already
                pass


class FakeDebugMode:
    """Stands in for torch's debug-mode switch on a machine without CUDA.

    Attributes:
        level: the level torch would be at.
        history: every level set, in order (tests check arming and restoring).
    """

    def __init__(self, level: int = LEVEL_OFF):
        self.level = level
        self.history: list[int] = []

    def unavailable_reason(self) -> str | None:
        return None

    def get(self) -> int:
        return self.level

    def set(self, level: int) -> None:
        self.level = level
        self.history.append(level)


_backend: TorchDebugMode | FakeDebugMode = TorchDebugMode()


def backend() -> TorchDebugMode | FakeDebugMode:
    """Return the debug-mode switch in use."""
    return _backend


@contextlib.contextmanager
def fake(level: int = LEVEL_OFF) -> Iterator[FakeDebugMode]:
    """Use a :class:`FakeDebugMode` for the duration of the block (tests only)."""
    global _backend
    previous = _backend
    stand_in = FakeDebugMode(level)
    _backend = stand_in
    try:
        yield stand_in
    finally:
        _backend = previous


class _Armer:
    """Reference count of active checked regions, process-wide.

    Every region entry (on any thread or task) adds one, every exit removes
    one. The 0 -> 1 step saves the current level and sets "warn"; the 1 -> 0
    step restores the saved level, unless the user set another level while
    armed (``torch.cuda.set_sync_debug_mode``): theirs is the newer choice and
    stays. Under the lock, so two threads that enter and leave at the same
    time cannot both save or both restore.

    A user level of "error" is kept in spirit while armed: the hook raises
    torch's error for a sync outside a region (:mod:`._hook`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._saved = LEVEL_OFF
        self._armed_on: TorchDebugMode | FakeDebugMode | None = None
        # Called (with no lock held) after the last region closed: the hook may leave then (see ._hook).
        self.on_disarmed = None

    @property
    def count(self) -> int:
        return self._count

    @property
    def saved_level(self) -> int:
        """The level the user asked for: the one before the detector armed, or one they set since."""
        switch = self._armed_on
        if not self._count or switch is None:
            return _backend.get()
        current = switch.get()
        return self._saved if current == LEVEL_WARN else current

    def arm(self) -> None:
        with self._lock:
            if self._count == 0:
                self._armed_on = _backend
                self._saved = _backend.get()
                if self._saved != LEVEL_WARN:
                    _backend.set(LEVEL_WARN)
            self._count += 1

    def disarm(self) -> None:
        with self._lock:
            if self._count == 0:
                return
            self._count -= 1
            if self._count or self._armed_on is None:
                return
            # Restore on the switch we armed, even if a test swapped backends since; a level other than
            # ours was set by the user while we were armed, and stays.
            if self._armed_on.get() == LEVEL_WARN and self._saved != LEVEL_WARN:
                self._armed_on.set(self._saved)
            self._armed_on = None
        if self.on_disarmed is not None:
            self.on_disarmed()


armer = _Armer()

"""Where the detector stands: the mode, the gate, and per-thread/per-task regions.

The mode comes from ``SYNCLESS_SYNC_CHECK``, read once at import, and can be
changed with :func:`set_mode`. A bad value never makes the import fail: the
mode falls back to ``off``, one warning names the variable, the value and the
allowed values, and :func:`env_error` keeps the message for ``doctor``.

Region depths live in ContextVars, so each thread and each asyncio task has
its own. A ContextVar is also inherited by code that runs in a *copy* of the
context (``asyncio.to_thread``, ``contextvars.copy_context().run`` on another
thread, a task created inside a region), so each region also records its
owner, the thread and task that entered it: a sync is a violation only on
that thread, in that task, while it is inside a checked region and outside
every allow region it entered itself.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from contextvars import ContextVar, Token

from syncless._core import config
from syncless._core.errors import ConfigError
from syncless.syncs import _debugmode

MODES = ("off", "warn", "error", "record")
ENV_VAR = "SYNCLESS_SYNC_CHECK"

_log = logging.getLogger(__name__)


class SyncCheckConfigWarning(UserWarning):
    """``SYNCLESS_SYNC_CHECK`` has a value that is not allowed; the detector runs as ``off``."""


def _mode_from_env() -> tuple[str, str | None]:
    """Return (mode, error message or None) for ``SYNCLESS_SYNC_CHECK``; never raises for a bad value."""
    try:
        return config.read(ENV_VAR), None
    except ConfigError as err:
        return "off", str(err)


def _warn_once(message: str) -> None:
    """Issue the bad-value warning; under ``-W error`` log it instead, so that the import still succeeds."""
    message = f"{message}; the hidden-sync detector stays off"
    try:
        # Line 0 of this module: Python prints the warning as one line, with no source line under it.
        warnings.warn_explicit(message, SyncCheckConfigWarning, __file__, 0, module=__name__)
    except SyncCheckConfigWarning:
        _log.warning("%s", message)


class _Settings:
    """Process-wide switches (one instance; the plugin saves and restores them)."""

    def __init__(self) -> None:
        self.mode, self.env_error = _mode_from_env()
        self.enabled = False
        self.lock = threading.RLock()


settings = _Settings()
if settings.env_error is not None:
    _warn_once(settings.env_error)


def env_error() -> str | None:
    """Return why ``SYNCLESS_SYNC_CHECK`` was refused at import (the mode then started ``off``), or None.

    The message names the variable, the value given and the values allowed.
    It describes the environment as read at import; :func:`set_mode` changes
    the mode but not this.
    """
    return settings.env_error


# How many checked regions this thread/task is inside, and how many allow regions. Read on every
# wrapped call, so they stay plain ints; the owners below are read only when a depth is non-zero.
checked_depth: ContextVar[int] = ContextVar("syncless_checked_depth", default=0)
allowed_depth: ContextVar[int] = ContextVar("syncless_allowed_depth", default=0)
# Who entered the outermost region counted in the depth above: (thread, asyncio task or None).
_checked_owner: ContextVar[tuple | None] = ContextVar("syncless_checked_owner", default=None)
_allowed_owner: ContextVar[tuple | None] = ContextVar("syncless_allowed_owner", default=None)


def _here() -> tuple:
    """(this thread, the running asyncio task or None): who a region belongs to.

    The thread object, not its id: ids are reused once a thread ends, objects
    are not while a region refers to them.
    """
    task = None
    asyncio = sys.modules.get("asyncio")  # not imported: no event loop can be running
    if asyncio is not None and asyncio._get_running_loop() is not None:
        task = asyncio.current_task()
    return threading.current_thread(), task


def _is_mine(owner: tuple | None) -> bool:
    if owner is None:
        return False
    thread, task = _here()
    return owner[0] is thread and owner[1] is task


def _not_installed() -> None:
    return None


# Set by ._hook when it is imported: puts the warnings hook and filter back in front.
reassert_warnings = _not_installed

# Call sites of allowed(first_only=True) already entered once: (filename, line).
_first_only_seen: set[tuple[str, int]] = set()


def validate_mode(mode: object) -> str:
    """Return ``mode`` if it is one of :data:`MODES` (as ``SYNCLESS_SYNC_CHECK`` reads it); raise otherwise."""
    return config.check_choice(mode, "mode", "SYNCLESS_SYNC_CHECK")


def is_violation_context() -> bool:
    """Return whether a sync here, now, is a violation (ignoring compile-time work).

    True when the detector is enabled, the mode is not off, and this
    thread/task is inside a checked region and outside every allow region.
    """
    if checked_depth.get() <= 0 or not settings.enabled or settings.mode == "off":
        return False
    if not _is_mine(_checked_owner.get()):
        return False  # a region entered elsewhere, seen through a copied context
    return allowed_depth.get() <= 0 or not _is_mine(_allowed_owner.get())


class RegionToken:
    """What entering a checked region changed, so that leaving undoes exactly that."""

    __slots__ = ("depth_token", "owner_token")

    def __init__(self, depth_token: Token[int], owner_token: Token[tuple | None]):
        self.depth_token = depth_token
        self.owner_token = owner_token


def _enter(depth: ContextVar[int], owner: ContextVar[tuple | None]) -> tuple[Token[int], Token[tuple | None]]:
    """Count one more region of ``depth``'s kind here; a count inherited from another owner restarts at 1."""
    here = _here()
    current = owner.get()
    if current is not None and current[0] is here[0] and current[1] is here[1]:
        return depth.set(depth.get() + 1), owner.set(current)
    return depth.set(1), owner.set(here)


def enter_checked() -> RegionToken | None:
    """Enter a checked region on this thread/task; None if the gate is closed.

    Arms torch's debug mode (reference-counted) and re-asserts the warnings
    hook and filter, which a ``catch_warnings`` block may have swapped out.
    """
    if not settings.enabled:
        return None
    token = RegionToken(*_enter(checked_depth, _checked_owner))
    _debugmode.armer.arm()
    if not settings.enabled:  # disable() ran between the check above and the arming: no region after all
        exit_checked(token)
        return None
    reassert_warnings()
    return token


def exit_checked(token: RegionToken | None) -> None:
    """Leave the region entered with ``token``."""
    if token is None:
        return
    _checked_owner.reset(token.owner_token)
    checked_depth.reset(token.depth_token)
    _debugmode.armer.disarm()


def enter_allowed(site: tuple[str, int] | None) -> tuple[Token[int], Token[tuple | None]] | None:
    """Enter an allow region; with a ``site`` only its first entry allows.

    Returns None when this entry does not allow (a repeated first-only site,
    or the gate is closed), so syncs in the block stay violations.
    """
    if site is not None:
        if not settings.enabled:
            return None
        if site in _first_only_seen:
            return None
        _first_only_seen.add(site)
    return _enter(allowed_depth, _allowed_owner)


def exit_allowed(token: tuple[Token[int], Token[tuple | None]] | None) -> None:
    """Leave the allow region entered with ``token``."""
    if token is not None:
        _allowed_owner.reset(token[1])
        allowed_depth.reset(token[0])


def forget_first_only_sites() -> None:
    """Let every ``allowed(first_only=True)`` site allow once more."""
    _first_only_seen.clear()


def caller_site(depth: int) -> tuple[str, int]:
    """Return (filename, line) of the frame ``depth`` levels above the caller."""
    frame = sys._getframe(depth + 1)
    return frame.f_code.co_filename, frame.f_lineno

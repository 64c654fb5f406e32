"""Where the detector stands: the mode, the gate, and per-thread/per-task regions.

The mode comes from ``SYNCLESS_SYNC_CHECK``, read once at import, and can be
changed with :func:`set_mode`. Region depths live in ContextVars, so each
thread and each asyncio task has its own: a sync is a violation only where
*that* thread (task) is inside a checked region and outside every allow
region.
"""

from __future__ import annotations

import sys
import threading
from contextvars import ContextVar, Token

from syncless._core import config
from syncless.syncs import _debugmode

MODES = ("off", "warn", "error", "record")


class _Settings:
    """Process-wide switches (one instance; the plugin saves and restores them)."""

    def __init__(self) -> None:
        self.mode: str = config.read("SYNCLESS_SYNC_CHECK")
        self.enabled = False
        self.lock = threading.RLock()


settings = _Settings()

# How many checked regions this thread/task is inside, and how many allow regions.
checked_depth: ContextVar[int] = ContextVar("syncless_checked_depth", default=0)
allowed_depth: ContextVar[int] = ContextVar("syncless_allowed_depth", default=0)


def _not_installed() -> None:
    return None


# Set by ._hook when it is imported: puts the warnings hook and filter back in front.
reassert_warnings = _not_installed

# Call sites of allowed(first_only=True) already entered once: (filename, line).
_first_only_seen: set[tuple[str, int]] = set()


def validate_mode(mode: object) -> str:
    """Return ``mode`` if it is one of :data:`MODES`; raise otherwise."""
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, one of {', '.join(MODES)}; got {type(mode).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def is_violation_context() -> bool:
    """Return whether a sync here, now, is a violation (ignoring compile-time work).

    True when the detector is enabled, the mode is not off, and this
    thread/task is inside a checked region and outside every allow region.
    """
    return (
        checked_depth.get() > 0
        and allowed_depth.get() == 0
        and settings.enabled
        and settings.mode != "off"
    )


class RegionToken:
    """What entering a checked region changed, so that leaving undoes exactly that."""

    __slots__ = ("depth_token",)

    def __init__(self, depth_token: Token[int]):
        self.depth_token = depth_token


def enter_checked() -> RegionToken | None:
    """Enter a checked region on this thread/task; None if the gate is closed.

    Arms torch's debug mode (reference-counted) and re-asserts the warnings
    hook and filter, which a ``catch_warnings`` block may have swapped out.
    """
    if not settings.enabled:
        return None
    token = RegionToken(checked_depth.set(checked_depth.get() + 1))
    _debugmode.armer.arm()
    reassert_warnings()
    return token


def exit_checked(token: RegionToken | None) -> None:
    """Leave the region entered with ``token``."""
    if token is None:
        return
    checked_depth.reset(token.depth_token)
    _debugmode.armer.disarm()


def enter_allowed(site: tuple[str, int] | None) -> Token[int] | None:
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
    return allowed_depth.set(allowed_depth.get() + 1)


def exit_allowed(token: Token[int] | None) -> None:
    if token is not None:
        allowed_depth.reset(token)


def forget_first_only_sites() -> None:
    """Let every ``allowed(first_only=True)`` site allow once more."""
    _first_only_seen.clear()


def caller_site(depth: int) -> tuple[str, int]:
    """Return (filename, line) of the frame ``depth`` levels above the caller."""
    frame = sys._getframe(depth + 1)
    return frame.f_code.co_filename, frame.f_lineno

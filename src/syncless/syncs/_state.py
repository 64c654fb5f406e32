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

import contextlib
import inspect
import logging
import sys
import threading
import time
import warnings
from contextvars import ContextVar, Token
from types import FrameType

from syncless._core import config
from syncless.syncs import _debugmode

MODES = ("off", "warn", "error", "record")
ENV_VAR = "SYNCLESS_SYNC_CHECK"

_log = logging.getLogger(__name__)


class SyncCheckConfigWarning(UserWarning):
    """A detector setting read at import has a value that is not allowed; it falls back to its default.

    ``SYNCLESS_SYNC_CHECK`` (the detector then runs as ``off``),
    ``SYNCLESS_SYNC_BACKEND`` (then ``auto``) and, in :mod:`syncless.compat.vllm`,
    ``VLLM_GPU_SYNC_CHECK`` (then unset).
    """


def warn_bad_setting(message: str, consequence: str) -> None:
    """Issue the bad-value warning; under ``-W error`` log it instead, so that the import still succeeds."""
    message = f"{message}; {consequence}"
    try:
        # Line 0 of this module: Python prints the warning as one line, with no source line under it.
        warnings.warn_explicit(message, SyncCheckConfigWarning, __file__, 0, module=__name__)
    except SyncCheckConfigWarning:
        _log.warning("%s", message)


class _Settings:
    """Process-wide switches (one instance; the plugin saves and restores them)."""

    def __init__(self) -> None:
        self.mode, self.env_error = config.read_or_default(ENV_VAR)
        self.enabled = False
        self.timeline = False  # syncs.record_timeline(): regions are kept with their times (._timeline)
        self.lock = threading.RLock()


settings = _Settings()
if settings.env_error is not None:
    warn_bad_setting(settings.env_error, "the hidden-sync detector stays off")


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
# Who entered the outermost region counted in the depth above (an _Owner).
_checked_owner: ContextVar["_Owner | None"] = ContextVar("syncless_checked_owner", default=None)
_allowed_owner: ContextVar["_Owner | None"] = ContextVar("syncless_allowed_owner", default=None)

_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR
_CONTEXTLIB_FILE = contextlib.__file__


class _Owner:
    """The thread and asyncio task that entered an outermost region, and whether any of its regions is open.

    A copied context (a task or thread started inside the region, a generator
    resumed elsewhere) keeps seeing the depth its parent had; ``open`` goes
    False when the last region counted here ends, wherever it ends, so that
    what a copy still sees is inert. ``regions`` counts the open regions of
    this owner: they may end in any order (a generator's region closed inside
    its consumer's), and the owner stays open while one is left. For allow
    regions it also holds what the open ones cover: ``unscoped`` counts plain
    ones; ``scopes`` holds the ids of generator frames that entered one (it
    covers only what runs while that frame runs).
    """

    __slots__ = ("thread", "task", "open", "regions", "unscoped", "scopes")

    def __init__(self, thread: threading.Thread, task: object) -> None:
        self.thread = thread
        self.task = task
        self.open = True
        self.regions = 1
        self.unscoped = 0
        self.scopes: list[int] = []


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


def _is_mine(owner: _Owner | None) -> bool:
    if owner is None or not owner.open:
        return False
    thread, task = _here()
    return owner.thread is thread and owner.task is task


def _is_running(frame_ids: list[int]) -> bool:
    """Whether one of the frames (by id) is executing on this thread now."""
    frame = sys._getframe(1)
    while frame is not None:
        if id(frame) in frame_ids:
            return True
        frame = frame.f_back
    return False


def _not_installed() -> None:
    return None


# Set by ._hook when it is imported: puts the warnings hook and filter back in front.
reassert_warnings = _not_installed
def _no_timeline(started_ns: int) -> None:
    return None


# Set by ._timeline: keeps an outermost checked region that started at ``started_ns`` (time.time_ns()) and ends now.
on_region_closed = _no_timeline

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
    if allowed_depth.get() <= 0:
        return True
    owner = _allowed_owner.get()
    if not _is_mine(owner):
        return True
    # A generator suspended inside `with allowed():` allows nothing to its consumer.
    return not owner.unscoped and not (owner.scopes and _is_running(owner.scopes))


class RegionToken:
    """What entering a region changed, so that leaving undoes exactly that (wherever it is left).

    Attributes:
        outermost: the entry started a new owner (the first region of this thread/task in this context).
        level: the depth this entry set; leaving finds it still there only if it is left last-in, first-out.
        events: the CUPTI layer's state of an outermost checked region (set by ``._backend``).
    """

    __slots__ = ("depth_token", "owner_token", "owner", "outermost", "level", "scope", "events", "events_token",
                 "started_ns")

    def __init__(self, depth_token: Token[int], owner_token: Token, owner: _Owner, outermost: bool, level: int):
        self.depth_token = depth_token
        self.owner_token = owner_token
        self.owner = owner
        self.outermost = outermost
        self.level = level
        self.scope: int | None = None
        self.events = None
        self.events_token: Token | None = None
        self.started_ns = 0  # time.time_ns() at entry, while the timeline is recorded


def _enter(depth: ContextVar[int], owner: ContextVar[_Owner | None]) -> RegionToken:
    """Count one more region of ``depth``'s kind here; a count inherited from another owner restarts at 1."""
    thread, task = _here()
    current = owner.get()
    if current is not None and current.open and current.thread is thread and current.task is task:
        current.regions += 1
        level = depth.get() + 1
        return RegionToken(depth.set(level), owner.set(current), current, False, level)
    fresh = _Owner(thread, task)
    return RegionToken(depth.set(1), owner.set(fresh), fresh, True, 1)


def _leave(token: RegionToken, depth: ContextVar[int], owner: ContextVar[_Owner | None]) -> None:
    """Undo ``_enter``.

    Left last-in, first-out (the depth is still the one this entry set, under
    its owner), the variables are reset. A region left out of order (a
    generator's, closed inside a region its consumer entered later) takes one
    off the depth instead, so that the later region keeps its own. A region
    left in another context than its own (a generator resumed on another
    thread) cannot change that context's variables: when it was its owner's
    last, the owner is closed, and what that context still holds is inert.
    """
    held = token.owner
    held.regions -= 1
    if held.regions <= 0:
        held.open = False  # also makes copies of this context that outlive the region inert
    if owner.get() is not held:
        return  # another context, or one whose variables moved on: nothing here is this region's
    if depth.get() != token.level:
        depth.set(max(depth.get() - 1, 0))  # left out of order: the regions entered after it stay counted
        return
    try:
        owner.reset(token.owner_token)
        depth.reset(token.depth_token)
    except ValueError:  # the tokens belong to another context
        pass


def enter_checked() -> RegionToken | None:
    """Enter a checked region on this thread/task; None if the gate is closed.

    Arms torch's debug mode (reference-counted) and re-asserts the warnings
    hook and filter, which a ``catch_warnings`` block may have swapped out.
    """
    if not settings.enabled:
        return None
    token = _enter(checked_depth, _checked_owner)
    _debugmode.armer.arm()
    if not settings.enabled:  # disable() ran between the check above and the arming: no region after all
        exit_checked(token)
        return None
    reassert_warnings()
    if settings.timeline and token.outermost:
        token.started_ns = time.time_ns()
    return token


def exit_checked(token: RegionToken | None) -> None:
    """Leave the region entered with ``token`` (on any thread: the disarm always happens)."""
    if token is None:
        return
    if token.started_ns:
        on_region_closed(token.started_ns)
    try:
        _leave(token, checked_depth, _checked_owner)
    finally:
        _debugmode.armer.disarm()


def enter_allowed(site: tuple[str, int] | None, frame: FrameType | None = None) -> RegionToken | None:
    """Enter an allow region; with a ``site`` only its first entry allows.

    ``frame`` is the frame whose ``with`` entered it: a generator frame's
    allow region covers only what runs while that generator runs (unless
    ``contextlib.contextmanager`` drives it: then it covers the ``with`` block).

    Returns None when this entry does not allow (a repeated first-only site,
    or the gate is closed), so syncs in the block stay violations.
    """
    if site is not None:
        if not settings.enabled:
            return None
        if site in _first_only_seen:
            return None
        _first_only_seen.add(site)
    token = _enter(allowed_depth, _allowed_owner)
    if (frame is not None and frame.f_code.co_flags & _GENERATOR_FLAGS
            and (frame.f_back is None or frame.f_back.f_code.co_filename != _CONTEXTLIB_FILE)):
        token.scope = id(frame)
        token.owner.scopes.append(token.scope)
    else:
        token.owner.unscoped += 1
    return token


def exit_allowed(token: RegionToken | None) -> None:
    """Leave the allow region entered with ``token``."""
    if token is None:
        return
    if token.scope is None:
        token.owner.unscoped -= 1
    elif token.scope in token.owner.scopes:
        token.owner.scopes.remove(token.scope)
    _leave(token, allowed_depth, _allowed_owner)


class TokenStack:
    """The tokens of one context-manager object, so that it can be entered again before it is left.

    A reused ``allowed()``/``checking()`` object entered twice (recursion, or
    several threads) keeps each entry's token with the thread/task that made
    it: the one leaving takes back its own latest entry. Each thread/task has
    its own list, which only it adds to, so threads that share the object
    never act on each other's entries and no lock is taken: a dict's
    ``setdefault``/``get`` and a list's ``append``/``pop`` are each one step
    for the interpreter. An entry that opened no region (the gate closed, a
    repeated first-only site) is kept as None. An exit with no entry of its
    own (a generator resumed on another thread than the one that entered)
    takes another thread's latest entry.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[tuple, list[RegionToken | None]] = {}

    def push(self, token: RegionToken | None) -> None:
        """Keep this entry's token (None: it opened no region) for this thread/task's exit to take back."""
        self._entries.setdefault(_here(), []).append(token)

    def pop(self) -> RegionToken | None:
        """This thread/task's latest entry: its token, or None for one that opened no region."""
        who = _here()
        mine = self._entries.get(who)
        if mine is not None:
            try:
                token = mine.pop()
            except IndexError:  # taken by an exit made elsewhere (see below)
                token = None
            if not mine:
                self._entries.pop(who, None)  # only this thread/task adds to its own list
            return token
        # Left elsewhere than entered: the latest entry of another thread/task. Its list stays in the dict
        # (its owner may be adding to it now); emptied, it is dropped by its owner's next exit.
        for entries in list(self._entries.values()):
            try:
                return entries.pop()
            except IndexError:
                continue
        return None


def forget_first_only_sites() -> None:
    """Let every ``allowed(first_only=True)`` site allow once more."""
    _first_only_seen.clear()


def caller_site(depth: int) -> tuple[str, int]:
    """Return (filename, line) of the frame ``depth`` levels above the caller."""
    frame = sys._getframe(depth + 1)
    return frame.f_code.co_filename, frame.f_lineno

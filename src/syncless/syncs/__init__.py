"""The hidden-sync detector: find GPU<->CPU syncs in code marked hot.

Typical use::

    from syncless import syncs

    @syncs.checked
    def decode_step(batch): ...

    load_model(); warm_up()
    syncs.enable()            # nothing is checked before this
    for batch in stream: decode_step(batch)

The mode comes from ``SYNCLESS_SYNC_CHECK`` (``off``, ``warn``, ``error``,
``record``), read once at import; a bad value warns once and leaves it ``off``
(:func:`env_error` says why). With ``off`` everything is free:
:func:`checked` returns the function itself and :func:`allowed` returns one
shared no-op context manager (a ``contextlib.nullcontext``).

Inside ``torch.compile`` (``fullgraph=True``, ``mode="reduce-overhead"``)
every construct compiles, in every mode, whether the function was compiled
before or after :func:`enable`; tracing reads no ContextVar, frame or event
loop and nothing that :func:`enable`/:func:`disable` flip, so flipping them
causes no recompile. Without ``fullgraph``, regions and allows written in
compiled code hold for the eager code run at its graph breaks (see
``._compiled``); a graph itself runs no Python to check. Eager code around a
compiled step is checked as before.

A sync is a violation only on the thread (asyncio task) that is inside a
checked region and outside every allow region. Explicit syncs (``.item()``,
``nonzero``, blocking copies, ...) are seen through torch's sync debug mode,
armed at "warn" while any region is active; implicit ones (``non_blocking``
copies that block anyway) through wrappers of ``Tensor.to``/``cuda``/``copy_``;
host waits (``torch.cuda.synchronize()``, ``Event.synchronize()``, ...)
through wrappers of those. With the CUPTI backend (``set_backend``,
``SYNCLESS_SYNC_BACKEND``, extra ``syncless[cupti]``) every driver/runtime
call that blocks the host is seen too, from any library, with the host time
it blocked (see ``docs/syncs.md``). Each recorded sync also shows on a
timeline: as a range in an active ``torch.profiler`` trace, on NVTX
(:func:`set_nvtx`), and, with :func:`record_timeline`, in
``report().to_chrome_trace()`` and ``report().plot()``. Nothing here enqueues
GPU work or blocks the host by itself.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from syncless._core.compiling import is_compiling
from syncless._core.errors import SyncViolation
from syncless._core.logs import log_once
from syncless.syncs import _compiled, _copies, _debugmode, _hook, _state, _waits
from syncless.syncs._backend import BACKENDS, BackendChoice, set_backend
from syncless.syncs._backend import backend as _layers
from syncless.syncs._backend import choice as backend_choice
from syncless.syncs._report import SyncReport, SyncSite, SyncWarning, Violation, recorder
from syncless.syncs._state import MODES, SyncCheckConfigWarning, env_error, settings
from syncless.syncs._timeline import Timeline, TimelineRegion, TimelineSync, record_timeline, set_nvtx

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "MODES",
    "SyncCheckConfigWarning",
    "SyncReport",
    "SyncSite",
    "SyncViolation",
    "SyncWarning",
    "Timeline",
    "TimelineRegion",
    "TimelineSync",
    "Violation",
    "allowed",
    "backend_choice",
    "checked",
    "checking",
    "disable",
    "enable",
    "env_error",
    "is_enabled",
    "mode",
    "print_report",
    "record_timeline",
    "report",
    "reset",
    "set_backend",
    "set_mode",
    "set_nvtx",
]

_log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


# The context manager handed out when the mode is off, and the one torch.compile traces: a plain
# nullcontext, which dynamo accepts (fullgraph=True refuses an unknown context manager). Stateless, so one
# instance serves every ``with``.
_NOOP = contextlib.nullcontext()


def mode() -> str:
    """Return the current mode: ``off``, ``warn``, ``error`` or ``record``."""
    return settings.mode


def set_mode(new_mode: str) -> None:
    """Set the mode, overriding ``SYNCLESS_SYNC_CHECK``.

    :func:`checked` decides when it decorates: a function decorated while the
    mode was ``off`` stays unchecked. Set the mode before importing the code
    that uses the decorator.

    Raises:
        ValueError: ``new_mode`` is not one of :data:`MODES`.
    """
    settings.mode = _state.validate_mode(new_mode)


def is_enabled() -> bool:
    """Return whether :func:`enable` has opened the gate (and there is something to check)."""
    return settings.enabled


def enable() -> bool:
    """Open the gate: from now on syncs in checked regions count.

    Installs the warnings hook and the wrappers of ``Tensor.to``/``cuda``/
    ``copy_`` and of the host waits. Call it after model load and warm-up,
    so that set-up may synchronize freely. Idempotent.

    Returns:
        True if the detector is active. False when the mode is ``off``, or
        when this torch build has no CUDA sync debug mode or no GPU (said
        once in the log); everything then stays a no-op.

    Raises:
        MissingDependencyError: the backend ``cupti`` was chosen and
            cupti-python is not installed (on any machine).
    """
    with settings.lock:
        if settings.enabled:
            return True
        if settings.mode == "off":
            recorder.not_checked = "the detector is off (SYNCLESS_SYNC_CHECK=off, or syncs.set_mode('off'))"
            return False
        _layers.require()
        reason = _debugmode.backend().unavailable_reason()
        if reason is not None:
            recorder.not_checked = reason
            log_once(_log, logging.WARNING, "syncs-nothing-to-check",
                     "syncless.syncs: nothing to check: %s; the detector stays off", reason)
            return False
        _layers.activate()
        _keep_bookkeeping_out_of_dynamo()
        _hook.install()
        _copies.install()
        _waits.install()
        settings.enabled = True
        recorder.not_checked = None
        if settings.mode == "record":
            recorder.print_at_exit()
        return True


def disable() -> None:
    """Close the gate and put back everything :func:`enable` changed.

    ``Tensor.to``/``cuda``/``copy_`` and the waits come back by identity (or
    to the layer beneath, if another syncless capability patched them too; a
    patch another library put over ours stays, and ours passes through);
    the warnings hook and filter are removed. Regions still open keep their
    bookkeeping and restore torch's debug mode when they close.
    """
    with settings.lock:
        settings.enabled = False
        _layers.deactivate()
        _waits.uninstall()
        _copies.uninstall()
        _hook.uninstall()


def checked(fn: F) -> F:
    """Decorate ``fn`` so that its body is a checked region on the calling thread.

    With the mode ``off`` this returns ``fn`` itself. Coroutine functions are
    checked across their awaits (the region belongs to the task); an event
    loop that ``fn`` runs itself (``asyncio.run``) runs its tasks unchecked.
    ``torch.compile(checked(fn))`` is a region around the compiled ``fn``
    (dynamo never compiles the wrapper's own frame). A call inlined into a
    compiled caller is a region at its graph breaks, not inside a graph
    (a ``fullgraph=True`` graph warns once); tracing it reads nothing that
    :func:`enable`/:func:`disable` change, so they cause no recompile.
    """
    if not callable(fn):
        raise TypeError(f"checked decorates a function; got {type(fn).__name__}")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"checked cannot check the generator function {fn.__qualname__}: its body runs later, while it is "
            "iterated, outside the call; put `with syncless.syncs.checking():` around the loop that consumes it"
        )
    if settings.mode == "off":
        return fn
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            token = _state.enter_checked()
            _layers.entered(token)
            failing = True  # not sys.exc_info(): inside an `except` block of the caller it names the caller's error
            try:
                result = await fn(*args, **kwargs)
                failing = False
                return result
            finally:
                _state.exit_checked(token)
                _layers.exited(token, failing=failing)

        return async_wrapper  # type: ignore[return-value]

    qualname = getattr(fn, "__qualname__", repr(fn))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            # dynamo inlines this call into a compiled caller (its own frames are never compiled: see
            # _compiled). Asked first, before settings.enabled: dynamo would guard on the flag, and a step
            # compiled at warm-up would recompile at its first call after enable(). A graph break in fn makes
            # dynamo run this whole call eagerly, a region; under fullgraph=True the graph runs no Python.
            if not _compiled.graph_breaks_allowed():
                _compiled.say_not_a_region(qualname)
            return fn(*args, **kwargs)
        token = _state.enter_checked()
        _layers.entered(token)
        failing = True  # see async_wrapper
        try:
            result = fn(*args, **kwargs)
            failing = False
            return result
        finally:
            _state.exit_checked(token)
            _layers.exited(token, failing=failing)

    _run_wrapper_frames_eagerly(wrapper)
    return wrapper  # type: ignore[return-value]


def _run_wrapper_frames_eagerly(wrapper: Callable[..., Any]) -> None:
    """Keep dynamo from compiling ``checked``'s wrapper frames (shared code: marked once), importing torch."""
    try:
        import torch  # noqa: F401 - the mark lives in torch's C module
    except ImportError:  # no torch: nothing can compile the wrapper
        return
    _compiled.run_frames_eagerly(wrapper.__code__)
    _keep_bookkeeping_out_of_dynamo()


def _keep_bookkeeping_out_of_dynamo() -> None:
    """Mark what a region runs eagerly in the middle of a compiled call (see ``_compiled.keep_out_of_dynamo``)."""
    _compiled.keep_out_of_dynamo(
        _state.enter_checked, _state.exit_checked, _state.enter_allowed, _state.exit_allowed,
        type(_layers).entered, type(_layers).exited, _Checking.__enter__, _Checking.__exit__,
        _Allowing.__enter__, _Allowing.__exit__)


class _Checking:
    __slots__ = ("_tokens",)

    def __init__(self) -> None:
        self._tokens = _state.TokenStack()  # one per entry: the object may be entered again before it is left

    def __enter__(self) -> None:
        if is_compiling():
            return  # traced by torch.compile: not a region (see checked); no guard on settings.enabled
        token = _state.enter_checked()
        self._tokens.push(token)
        _layers.entered(token)

    def __exit__(self, *exc_info: object) -> None:
        if is_compiling():
            return  # its entry was traced too: nothing was kept
        token = self._tokens.pop()
        if token is None:
            return
        _state.exit_checked(token)
        _layers.exited(token, failing=exc_info[1] is not None)


def checking() -> Any:
    """Return a context manager whose block is a checked region on this thread/task.

    Regions nest. Use a fresh one per ``with`` (each call returns one).
    While ``torch.compile`` traces, returns a ``nullcontext`` (see the module docstring).
    """
    # The mode first: it keeps "off" free in eager code, and it flips only by set_mode(), never by
    # enable()/disable(), so the guard dynamo puts on it costs no recompile. Then is_compiling(), before
    # anything a region reads (ContextVars, the event loop), none of which dynamo can trace.
    if settings.mode == "off":
        return _NOOP
    if is_compiling():
        return _traced_region()
    return _Checking()


def _traced_region() -> Any:
    """What a construct is while dynamo traces it: see ``_compiled`` (a graph break in it runs the function eagerly)."""
    return _compiled.TracedRegion() if _compiled.graph_breaks_allowed() else _NOOP


class _Allowing:
    __slots__ = ("_site", "_tokens")

    def __init__(self, site: tuple[str, int] | None) -> None:
        self._site = site
        self._tokens = _state.TokenStack()  # see _Checking

    def __enter__(self) -> None:
        if is_compiling():
            return  # an object made outside, traced by torch.compile: see _Checking
        # The frame of the `with`: a generator's allow region covers only what runs while it runs.
        self._tokens.push(_state.enter_allowed(self._site, sys._getframe(1)))

    def __exit__(self, *exc_info: object) -> None:
        if is_compiling():
            return
        _state.exit_allowed(self._tokens.pop())


def allowed(first_only: bool = False) -> Any:
    """Return a context manager that lets syncs through on this thread/task for its block.

    Args:
        first_only: allow only the first entry (while enabled) from this call
            site, so a sync that should happen once and keeps happening is
            still caught.

    An allow region covers everything inside it, nested checked regions too.
    While ``torch.compile`` traces, returns a ``nullcontext`` (see the module
    docstring): the call site is not read there.

    Raises:
        TypeError: ``first_only`` is not a bool.
    """
    return _allowed_for(first_only, 2)


def _allowed_for(first_only: bool, depth: int) -> Any:
    """:func:`allowed` for the caller ``depth`` frames above this one (1: the caller), whose line is the site.

    For adapters that wrap :func:`allowed` (``syncless.compat.vllm``): the
    first-only site must be their caller's line, not theirs.
    """
    if first_only is not True and first_only is not False:
        raise TypeError(f"allowed(first_only=...) expects a bool, got {type(first_only).__name__} {first_only!r}")
    # The order and the reasons are checking()'s; the call site (a frame read) comes after is_compiling().
    if settings.mode == "off":
        return _NOOP
    if is_compiling():
        return _traced_region()
    return _Allowing(_state.caller_site(depth) if first_only else None)


def report() -> SyncReport:
    """Return every call site recorded since the last :func:`reset` (all modes record)."""
    return recorder.report()


def print_report(file: Any = None, stacks: bool = True) -> None:
    """Print the table of call sites with counts and one stack each."""
    print(recorder.report().format(stacks=stacks), file=file)


def reset() -> None:
    """Forget the recorded sites, the timeline, and which ``allowed(first_only=True)`` sites were entered."""
    recorder.reset()
    _state.forget_first_only_sites()

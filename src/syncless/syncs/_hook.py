"""The ``warnings.showwarning`` hook that turns torch's sync warnings into violations.

With torch's debug mode at "warn", every synchronizing CUDA call (``.item()``,
``nonzero``, a blocking copy, ...) issues a UserWarning whose text starts
with :data:`TORCH_SYNC_TEXT`, attributed to the Python frame that made the
call. The warning reaches :func:`showwarning` on the thread that synchronized,
which decides: a thread (task) in a checked region and outside every allow
region gets the violation; every other thread gets nothing (its warning
exists only because another thread armed the process-wide debug mode).

Two things undo the hook from outside, and both are re-asserted on every
checked call (:func:`reassert`): ``warnings.catch_warnings`` (pytest wraps
each test in one) restores ``showwarning`` and the filter list, and the
default filter action would show a repeated warning from one line only once.

A ``catch_warnings`` block inside a region must not change what the
detector sees either (libraries hush their own warnings with one): while
installed, the "always" filter stays in front of filters added later
(``simplefilter``/``filterwarnings``, through the warnings module's
``_add_filter``), and torch's sync warnings are taken where the warnings
machinery hands a warning on (``warnings._showwarnmsg``, which
``catch_warnings(record=True)`` and ``pytest.warns`` leave in place), so
they never land in a user's list. The ``SyncWarning`` of ``warn`` mode goes
through the filters like any warning (``-W error::...SyncWarning``).
"""

from __future__ import annotations

import re
import sys
import threading
import warnings

from syncless._core.compiling import is_compiling
from syncless.syncs import _debugmode, _report, _state
from syncless.syncs._state import is_violation_context

TORCH_SYNC_TEXT = "called a synchronizing CUDA operation"
# torch says this once per process when its debug mode is first set: we set it, the user did not.
TORCH_PROTOTYPE_TEXT = "Synchronization debug mode is a prototype feature"

_lock = threading.RLock()
_filter_entry: tuple | None = None
_previous = None  # the showwarning we replaced most recently; non-sync warnings go there
_previous_filters = None  # warnings.filters (the list object) when we replaced _previous
_installed_over = None  # the showwarning in place when install() ran
_installed = False  # between install() and the hook's release
_leave_when_disarmed = False  # disable() came while a region was open: release when the last one closes
_local = threading.local()
# The warnings module's functions we wrap while installed (see the module docstring), and the originals.
_filter_globals = warnings.simplefilter.__globals__  # warnings.py's (3.14: _py_warnings.py's) globals
_original_add_filter = None
_original_showwarnmsg = None


def is_torch_sync_warning(message: object, category: type) -> bool:
    """Return whether a warning is torch's sync-debug-mode warning."""
    return issubclass(category, UserWarning) and str(message).startswith(TORCH_SYNC_TEXT)


def _forward(message, category, filename, lineno, file=None, line=None) -> None:
    """Deliver a warning we do not own to whoever handled warnings before us."""
    target = _previous
    if target is None or target is showwarning or getattr(_local, "forwarding", False):
        # Never loop through ourselves; fall back to the stdlib's own writer.
        target = warnings._showwarning_orig  # type: ignore[attr-defined]
    _local.forwarding = True
    try:
        target(message, category, filename, lineno, file, line)
    finally:
        _local.forwarding = False


def decide(message: object, category: type, start=None) -> _report.Violation | None:
    """Return the violation a torch sync warning is, here and now, or None.

    This is the decision the hook makes; it is separate so that tests can
    feed it torch's warning text on a machine without CUDA.

    Args:
        start: the frame to look for the user's code from (default: the caller's).
    """
    if not is_torch_sync_warning(message, category):
        return None
    if not is_violation_context():
        return None
    if is_compiling():  # torch is loaded: the warning came from it
        return None
    frame = start if start is not None else sys._getframe(1)
    return _report.locate(_report.KIND_EXPLICIT, None, _report.FIX_EXPLICIT, frame)


def showwarning(message, category, filename, lineno, file=None, line=None) -> None:
    """The hook: violations are handled per mode, other torch sync warnings dropped.

    Raises:
        SyncViolation: in ``error`` mode; it propagates out of the torch call
            that synchronized.
    """
    if not _installed:
        _step_out(message, category, filename, lineno, file, line)
        return
    if not is_torch_sync_warning(message, category):
        if not str(message).startswith(TORCH_PROTOTYPE_TEXT):
            _forward(message, category, filename, lineno, file, line)
        return
    _take_sync_warning(message, category, filename, lineno, file, line, _forward, sys._getframe(1))


def _take_sync_warning(message, category, filename, lineno, file, line, forward, start) -> None:
    """Decide what torch's sync warning is here; ``forward`` delivers it where the user wants torch's own."""
    violation = decide(message, category, start)
    if violation is not None:
        # Through warnings.warn_explicit in warn mode: the user's filters for SyncWarning apply.
        _report.handle(violation)
        return
    if is_violation_context():
        return
    user_level = _debugmode.armer.saved_level
    if user_level == _debugmode.LEVEL_ERROR:
        # The user asked torch to raise for every sync; we lowered the process to "warn" to sort syncs per
        # thread, so raise torch's error here (after the sync: torch raises before it).
        raise RuntimeError(TORCH_SYNC_TEXT)
    if user_level != _debugmode.LEVEL_OFF:
        # The user had torch's debug mode on before we armed it: keep their warnings.
        forward(message, category, filename, lineno, file, line)


def _showwarnmsg(msg) -> None:
    """Stands in for ``warnings._showwarnmsg`` while installed: torch's sync warnings come here, whatever
    ``showwarning`` is (a ``catch_warnings(record=True)`` list, ``pytest.warns``); every other warning goes on."""
    original = _original_showwarnmsg
    if original is None or original is _showwarnmsg:
        original = _showwarnmsg_fallback
    if _installed and msg.category is not None and is_torch_sync_warning(msg.message, msg.category):
        _take_sync_warning(msg.message, msg.category, msg.filename, msg.lineno, msg.file, msg.line,
                           lambda *_: original(msg), sys._getframe(1))
        return
    if _installed and str(msg.message).startswith(TORCH_PROTOTYPE_TEXT):
        return  # we set torch's debug mode, not the user
    original(msg)


def _showwarnmsg_fallback(msg) -> None:
    warnings._showwarnmsg_impl(msg)  # type: ignore[attr-defined]


def _could_catch_torch_sync(item: tuple) -> bool:
    """Whether a filter ``(action, message, category, module, lineno)`` could match torch's sync warning."""
    message, category = (item[1], item[2]) if len(item) >= 3 else (None, Warning)
    if not (isinstance(category, type) and issubclass(UserWarning, category)):
        return False
    return message is None or bool(getattr(message, "match", lambda text: True)(TORCH_SYNC_TEXT))


def _add_filter(*item, append):
    """Stands in for the warnings module's ``_add_filter`` while installed: our filter stays in front of any filter
    that could catch torch's sync warning; the order of the others is left as the user made it (so that
    ``filters.pop(0)`` right after ``filterwarnings(...)`` still takes the user's own filter)."""
    original = _original_add_filter
    original(*item, append=append)
    if not _installed or append or not _could_catch_torch_sync(item):
        return
    with _lock:
        filters = warnings.filters
        entry = _filter_entry
        if entry is not None and filters and filters[0] is not entry and entry in filters:
            filters.remove(entry)
            filters.insert(0, entry)
            mutated = getattr(warnings, "_filters_mutated", None)
            if callable(mutated):
                mutated()


# Which of our two functions are in the warnings module's chain: on top, or left beneath another library's wrapper
# at the last unwrap. One left beneath is still reachable (that wrapper calls it) and keeps its saved original; it
# is not wrapped again, which would save the library's wrapper, which calls ours, as "the original" and recurse on
# every warning.
_in_chain: set[str] = set()


def _wrap_warnings_module() -> None:
    """Put our ``_showwarnmsg`` and ``_add_filter`` in the warnings module (under ``_lock``; idempotent)."""
    global _original_add_filter, _original_showwarnmsg
    current = _filter_globals.get("_add_filter")
    if current is not None and "_add_filter" not in _in_chain:
        _original_add_filter = current
        _filter_globals["_add_filter"] = _add_filter
        _in_chain.add("_add_filter")
    current = getattr(warnings, "_showwarnmsg", None)
    if current is not None and "_showwarnmsg" not in _in_chain:
        _original_showwarnmsg = current
        warnings._showwarnmsg = _showwarnmsg  # type: ignore[attr-defined]
        _in_chain.add("_showwarnmsg")


def _unwrap_warnings_module() -> None:
    """Put the warnings module's functions back (under ``_lock``); a wrapper someone put over ours stays."""
    if "_add_filter" in _in_chain and _filter_globals.get("_add_filter") is _add_filter:
        _filter_globals["_add_filter"] = _original_add_filter
        _in_chain.discard("_add_filter")
    if "_showwarnmsg" in _in_chain and getattr(warnings, "_showwarnmsg", None) is _showwarnmsg:
        warnings._showwarnmsg = _original_showwarnmsg  # type: ignore[attr-defined]
        _in_chain.discard("_showwarnmsg")


def _step_out(message, category, filename, lineno, file=None, line=None) -> None:
    """The hook after its release, put back by someone who saved it: hand over to what was beneath it.

    A library that installed its showwarning over ours saved ours, and puts it
    back when it leaves (``logging.captureWarnings(False)``). Ours is gone by
    then: the function beneath ours takes its place again, and this warning.
    """
    target = _installed_over if _installed_over is not None else warnings._showwarning_orig  # type: ignore[attr-defined]
    if target is showwarning:
        target = warnings._showwarning_orig  # type: ignore[attr-defined]
    with _lock:
        if warnings.showwarning is showwarning and not _installed:
            warnings.showwarning = target
            forget_filters()  # a catch_warnings block that put the hook back put our filter back too
    target(message, category, filename, lineno, file, line)


def reassert() -> None:
    """Put the hook and the "always" filter back in front if something removed them.

    Cheap when nothing changed: two identity checks. Does nothing once the hook was released (a
    ``disable()`` that came between a region's gate check and its arming must not bring it back).
    """
    global _previous, _previous_filters, _filter_entry
    if not _installed:
        return
    if warnings.showwarning is not showwarning:
        with _lock:
            current = warnings.showwarning
            if current is not showwarning:
                _previous, _previous_filters = current, warnings.filters
                warnings.showwarning = showwarning
    filters = warnings.filters
    if _filter_entry is None or not filters or filters[0] is not _filter_entry:
        with _lock:
            warnings.filterwarnings("always", message=re.escape(TORCH_SYNC_TEXT), category=UserWarning)
            _filter_entry = warnings.filters[0]


_state.reassert_warnings = reassert


def install() -> None:
    """Install the hook and the filter (idempotent)."""
    global _installed_over, _installed, _leave_when_disarmed
    with _lock:
        if warnings.showwarning is not showwarning:
            _installed_over = warnings.showwarning
        _installed = True
        _leave_when_disarmed = False
        _debugmode.armer.on_disarmed = _leave_if_asked
        _wrap_warnings_module()
    reassert()


def forget_filters() -> None:
    """Remove every copy of our "always" filter, including ones a ``catch_warnings`` block put back."""
    pattern = re.escape(TORCH_SYNC_TEXT)
    ours = [f for f in warnings.filters
            if f[0] == "always" and f[2] is UserWarning and getattr(f[1], "pattern", None) == pattern]
    for entry in ours:
        warnings.filters.remove(entry)
    if ours:
        mutated = getattr(warnings, "_filters_mutated", None)
        if callable(mutated):
            mutated()


def uninstall() -> None:
    """Remove the filter and, if it is still ours, the hook; while a region is open, once the last one closes.

    An open region keeps torch's debug mode armed until it closes (see
    ``syncs.disable``); the hook stays until then, dropping the syncs that
    arming causes, so that no thread sees torch's raw warnings meanwhile.
    """
    global _leave_when_disarmed
    with _lock:
        if _debugmode.armer.count:
            _leave_when_disarmed = True
            return
        _leave()


def _leave_if_asked() -> None:
    """Called by the armer after the last region closed."""
    with _lock:
        if _leave_when_disarmed and not _debugmode.armer.count:
            _leave()


def _leave() -> None:
    """Release the hook: put back the showwarning it displaced, and forget the filter."""
    global _previous, _previous_filters, _filter_entry, _installed, _leave_when_disarmed
    _installed = False
    _leave_when_disarmed = False
    if warnings.showwarning is showwarning:
        if _previous is not None and warnings.filters is _previous_filters:
            # We displaced this one in the warnings context that is still in force (e.g. logging's
            # captureWarnings hook, installed after us): it stays.
            restore = _previous
        else:
            # A catch_warnings block we displaced a function in has closed since (pytest's, per test), or we
            # displaced nothing: what was there when we came.
            restore = _installed_over
        warnings.showwarning = restore if restore is not None else warnings._showwarning_orig  # type: ignore[attr-defined]
    _previous = _previous_filters = None
    _unwrap_warnings_module()
    # Every time: a catch_warnings block that closed since the last release may have put a copy back.
    forget_filters()
    _filter_entry = None

"""vLLM's sync-check and Confidential Computing names, backed by :mod:`syncless.syncs` and :mod:`syncless.cc`.

A port is one import line::

    # from vllm.utils.gpu_sync_debug import enable_gpu_sync_check, gpu_sync_allowed, with_gpu_sync_check
    # from vllm.v1.conf_compute_utils import install, new_external_d2h_stream, register_inplace_h2d_target
    from syncless.compat.vllm import (enable_gpu_sync_check, gpu_sync_allowed, with_gpu_sync_check,
                                      install, new_external_d2h_stream, register_inplace_h2d_target)

The sync check's mode comes from ``VLLM_GPU_SYNC_CHECK`` (unset or ``off``:
off; ``warn``; ``error``), read once at import into the module attribute
``_SYNC_CHECK_MODE`` (None, ``"warn"`` or ``"error"``), which every function
here reads when it is called: tests set that attribute (``monkeypatch.
setattr(vllm, "_SYNC_CHECK_MODE", "error")``), as vLLM's own tests do,
rather than the variable. A bad value warns once and leaves the check off.
When it is on, these names set syncless's own mode to it (overriding
``SYNCLESS_SYNC_CHECK``) and put syncless's own back when it is None again;
when it is None they follow syncless's own mode (``SYNCLESS_SYNC_CHECK``,
``pytest --sync-check``), so an allow written with the vLLM name holds under
either. In ``error`` mode a sync raises
:class:`syncless.SyncViolation`, a ``RuntimeError``. The deliberate
differences from vLLM's modules, and why, are in ``docs/porting-from-vllm.md``.

This module is an adapter over two capabilities (see :mod:`syncless.compat`);
importing it touches no CUDA API and needs no GPU.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from syncless import cc, syncs
from syncless._core.compiling import is_compiling

__all__ = [
    "enable_gpu_sync_check",
    "gpu_sync_allowed",
    "install",
    "new_external_d2h_stream",
    "register_inplace_h2d_target",
    "with_gpu_sync_check",
]

ENV_VAR = "VLLM_GPU_SYNC_CHECK"
VALUES = ("warn", "error")
#: Words that mean the check is off, as unset does.
OFF_VALUES = ("", "off")

F = TypeVar("F", bound=Callable[..., Any])

_SYNCLESS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def parse_mode(raw: str | None) -> tuple[str | None, str | None]:
    """Parse a ``VLLM_GPU_SYNC_CHECK`` text: ``(mode, None)``, or ``(None, why)`` for a value not allowed.

    The mode is None (unset, empty or ``off``), ``"warn"`` or ``"error"``; never raises, never warns.
    """
    if raw is None or raw.strip().lower() in OFF_VALUES:
        return None, None
    value = raw.strip().lower()
    if value in VALUES:
        return value, None
    return None, f"{ENV_VAR}={raw!r} is not one of: unset or off, {', '.join(VALUES)}"


def mode_from_env(environ: Any = None) -> str | None:
    """Return the check's mode from ``VLLM_GPU_SYNC_CHECK``: None (unset, empty or ``off``), ``"warn"`` or ``"error"``.

    A value that is none of these warns (:class:`syncless.syncs.SyncCheckConfigWarning`,
    naming the variable, the value and the values allowed, at the first line
    outside syncless: the ``import`` that read it) and returns None: a bad
    value never makes the import fail, as with ``SYNCLESS_SYNC_CHECK``.
    """
    mode, error = parse_mode((os.environ if environ is None else environ).get(ENV_VAR))
    if error is not None:
        _warn_at_user_line(f"{error}; the GPU sync check stays off")
    return mode


def _warn_at_user_line(message: str) -> None:
    """Warn, naming the first line outside syncless (and importlib's frames) as where it happened."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_SYNCLESS_DIR)
                                 or frame.f_code.co_filename.startswith("<frozen importlib")):
        frame = frame.f_back
    try:
        if frame is None:
            warnings.warn(message, syncs.SyncCheckConfigWarning, stacklevel=2)
            return
        module_globals = frame.f_globals
        warnings.warn_explicit(message, syncs.SyncCheckConfigWarning, frame.f_code.co_filename, frame.f_lineno,
                               module=module_globals.get("__name__"),
                               registry=module_globals.setdefault("__warningregistry__", {}))
    except syncs.SyncCheckConfigWarning:  # under -W error: the import still succeeds
        pass


# The seed's name: None (off), "warn" or "error". Read at every call, so a test may set it after import.
_SYNC_CHECK_MODE: str | None = mode_from_env()

# (the mode these names gave syncless, syncless's mode before), while _SYNC_CHECK_MODE overrides it.
_overridden: tuple[str, str] | None = None


def _apply_mode() -> str:
    """Give syncless ``_SYNC_CHECK_MODE`` when it is set, or put syncless's own back; return the mode in force.

    The names follow whichever of the two sets the mode: ``_SYNC_CHECK_MODE``
    (``VLLM_GPU_SYNC_CHECK``) when it is on, else syncless's own
    (``SYNCLESS_SYNC_CHECK``, ``syncs.set_mode``, ``pytest --sync-check``).
    """
    global _overridden
    mode = _SYNC_CHECK_MODE
    current = syncs.mode()
    if mode is not None:
        if current != mode:
            before = _overridden[1] if _overridden is not None else current
            syncs.set_mode(mode)
            _overridden = (mode, before)
        return mode
    if _overridden is not None:
        given, before = _overridden
        _overridden = None
        if current == given:  # nobody set another mode since: syncless's own comes back
            syncs.set_mode(before)
            return before
    return current


def enable_gpu_sync_check() -> None:
    """Turn the check on from now: call it once per worker, after model load and warm-up.

    Does nothing when the check is off (``_SYNC_CHECK_MODE`` None and
    syncless's own mode ``off``). Otherwise it is :func:`syncless.syncs.enable`:
    it installs the copy and wait checkers and torch's sync debug mode hook
    (compile-time work is never reported). Without a GPU, or on a torch
    without CUDA, nothing can be checked; that is logged once. Enqueues
    nothing and does not block the host.
    """
    if _apply_mode() == "off":
        return
    syncs.enable()


def with_gpu_sync_check(fn: F) -> F:
    """Check the syncs ``fn`` makes on its calling thread while the check is enabled.

    Returns ``fn`` itself when the check is off (decided here, when it
    decorates). Otherwise :func:`syncless.syncs.checked`: other threads (a
    transfer worker) are never checked; a call that torch.compile traces is
    not checked (the compiled graph runs no Python). What a sync then does
    (warn, raise) follows the mode in force when it happens, for every
    decorated function alike (``docs/porting-from-vllm.md``).
    """
    if _apply_mode() == "off":
        return fn
    return syncs.checked(fn)


def gpu_sync_allowed(first_only: bool = False) -> Any:
    """Return a context manager that allows syncs in its block, on this thread (and asyncio task).

    A ``contextlib.nullcontext()`` when the check is off or while
    torch.compile traces (so it compiles under ``fullgraph=True``). With
    ``first_only``, only the first entry from a call site (file and line) is
    allowed after the check was enabled; later ones are checked.

    Raises:
        TypeError: ``first_only`` is not a bool.
    """
    if first_only is not True and first_only is not False:
        raise TypeError(f"gpu_sync_allowed(first_only=...) expects a bool, got {type(first_only).__name__} "
                        f"{first_only!r}")
    if is_compiling():
        return contextlib.nullcontext()
    _apply_mode()
    return syncs._allowed_for(first_only, 2)  # the site is our caller's line, not this one; a nullcontext when off


def install() -> bool:
    """Install the Confidential Computing copy shim (call it once per worker process, under CC).

    :func:`syncless.cc.install` with mode ``"on"``, as vLLM's ``install()``
    installs unconditionally; if ``SYNCLESS_CC`` is set, that variable
    decides instead (``emulate`` to test on a GPU without CC, ``auto`` to ask
    NVML, ``off``). A second call changes nothing. Enqueues nothing and does
    not block the host.

    Returns:
        whether the shim is installed (vLLM's returns None). False on a torch
        without a usable CUDA GPU, where nothing is patched (warned once).

    Raises:
        MissingDependencyError: cuda-bindings older than 12.9.1 (the message gives the pip command).
    """
    return cc.install(None if os.environ.get("SYNCLESS_CC") else "on")


def new_external_d2h_stream(device: Any = None) -> Any:
    """Return a new D2H stream outside torch's pool, for the life of the process (:func:`syncless.cc.new_d2h_stream`).

    With the shim installed, a ``non_blocking`` device-to-host copy issued
    while it is current returns at once and its own worker thread performs
    it, ordered as if torch had run it on this stream. Enqueues nothing and
    does not block the host.

    Raises:
        NoGPUError: torch has no usable CUDA GPU (both a ``MissingDependencyError`` and a ``RuntimeError``, so a
            ported ``except RuntimeError`` catches it).
    """
    return cc.new_d2h_stream(device)


def register_inplace_h2d_target(t: Any) -> None:
    """Let ``non_blocking`` H2D copies into ``t`` (or a view) land in place on the staging stream.

    :func:`syncless.cc.register_inplace_h2d_target`: the caller promises that
    no GPU work reading or writing ``t`` is in flight when an upload rewrites
    it. The first registration makes the staging stream wait (GPU-side) for
    the current stream; it does not block the host. Unlike vLLM's, a bad
    argument raises instead of being ignored.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: ``t`` is not a strided CUDA tensor.
    """
    cc.register_inplace_h2d_target(t)

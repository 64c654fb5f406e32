"""Non-blocking host<->device copies under NVIDIA Confidential Computing.

Under CC, ``cudaMemcpyAsync`` between host and device returns only after the
copy and all earlier work on its stream. :func:`install` reroutes
``non_blocking`` copies so the host waits for the transfer alone (H2D on an
idle staging stream) or not at all (D2H on a stream from
:func:`new_d2h_stream`, performed by a worker thread). :func:`emulate`
reproduces CC's host-synchronous copies on GPUs without CC, for tests and
benchmarks. See docs/cc.md.
"""

from __future__ import annotations

import logging
import warnings

from syncless._core.logs import log_once
from syncless.cc import _host_writes, _raw
from syncless.cc._d2h import close_d2h_stream, is_d2h_stream, new_d2h_stream
from syncless.cc._detect import ModeDecision, cc_mode, decide_mode, is_confidential_compute
from syncless.cc._emulation import Emulation, is_emulating
from syncless.cc._shim import install_shim, is_shim_installed, uninstall_all
from syncless.cc._staging import is_registered_target, register_inplace_h2d_target
from syncless.cc._streams import check_bindings
from syncless.cc._stats import COUNTERS, LEFT_ALONE_REASONS, CopyStats
from syncless.cc._worker import D2HCopyError, D2HTimeoutError

_log = logging.getLogger(__name__)

__all__ = [
    "LEFT_ALONE_REASONS",
    "CopyStats",
    "D2HCopyError",
    "D2HTimeoutError",
    "Emulation",
    "ModeDecision",
    "cc_mode",
    "close_d2h_stream",
    "decide_mode",
    "emulate",
    "install",
    "is_confidential_compute",
    "is_d2h_stream",
    "is_emulating",
    "is_installed",
    "is_registered_target",
    "new_d2h_stream",
    "register_inplace_h2d_target",
    "reset_stats",
    "stats",
    "uninstall",
]


def install(mode: str | None = None, *, max_staged_bytes: int | None = None) -> bool:
    """Patch torch so ``non_blocking`` host<->device copies keep the host free under CC.

    Args:
        mode: ``"auto"`` (ask NVML), ``"on"`` (install the shim), ``"off"``
            (do nothing) or ``"emulate"`` (install the CC emulator and the
            shim); ``None`` reads ``SYNCLESS_CC``. Explicit beats the env.
        max_staged_bytes: H2D copies larger than this keep torch's copy;
            ``None`` reads ``SYNCLESS_CC_MAX_STAGED_BYTES``.

    Returns:
        whether the shim is installed after the call. Idempotent: a second
        call changes nothing but the size bound. On a torch without a usable
        CUDA GPU (``torch.cuda.is_available()`` is False) nothing is patched,
        whatever the mode (there is no host<->device copy to reroute or to
        emulate): a warning says so once and the call returns False. Enqueues
        nothing and does not block the host.

    Raises:
        MissingDependencyError: cuda-bindings older than 12.9.1 is installed
            (its driver calls hold the GIL; the message gives the pip command).
    """
    decision = decide_mode(mode)  # bad input raises here, before anything is patched
    if decision.mode == "off":
        log_once(_log, logging.INFO, "cc-install-off", "syncless.cc not installed: %s", decision.reason)
        return is_shim_installed()
    if not _cuda_available():
        _warn_no_cuda(f"mode {decision.mode!r}")
        return is_shim_installed()
    check_bindings()
    if decision.mode == "emulate":
        _emulation_install()
    install_shim(max_staged_bytes)
    # NVML said CC is on: a D2H torch issues has finished when its call returns (docs/cc.md, the fast lane).
    _host_writes.COPIES_FINISH_AT_CALL[0] = decision.requested == "auto" and decision.mode == "on"
    # CC emulated where NVML says it is off: the offloaded job's driver copy only enqueues (cc/_raw.run_copy_job).
    _raw.COPY_ONLY_ENQUEUES[0] = decision.mode == "emulate" and not is_confidential_compute()
    return True


_warned_no_cuda: set[str] = set()


def _warn_no_cuda(what: str) -> None:
    """Say once per process and form (a ``RuntimeWarning`` at the caller's line, and the log) that nothing is patched.

    A warning, as the docs say, so that ``warnings.catch_warnings`` and ``-W error`` see it (issue 35 item 9: it
    was only logged).
    """
    import torch

    text = (f"syncless.cc not installed: {what} needs a CUDA GPU, but torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}); host<->device copies stay torch's own")
    log_once(_log, logging.WARNING, f"cc-install-no-cuda:{what}", "%s", text)
    if what not in _warned_no_cuda:
        _warned_no_cuda.add(what)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def emulate() -> Emulation:
    """Make host<->device ``non_blocking`` copies host-synchronous, as under CC.

    Call it as a function (emulation stays until :func:`uninstall` or
    ``handle.stop()``) or use it as a context manager (emulation ends with
    the block, unless it was already on before). Each emulated copy blocks
    the host until the copy's stream has drained, as the driver does under CC.
    On a torch without a usable CUDA GPU it patches nothing and warns once,
    as ``install("emulate")`` does (``is_emulating()`` stays False).
    """
    if not _cuda_available():
        _warn_no_cuda("emulate()")
        return Emulation(start=False)
    return Emulation()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _emulation_install() -> None:
    from syncless.cc._emulation import install_emulation

    install_emulation()


def uninstall(timeout_s: float = 60.0) -> None:
    """Restore every attribute syncless.cc patched (shim and emulator), by identity.

    Blocks the host until the D2H copies already queued have finished, at
    most ``timeout_s``; the originals come back either way.

    Raises:
        TypeError: ``timeout_s`` is not a real number (checked before anything is restored).
        ValueError: ``timeout_s`` is negative or NaN (checked before anything is restored).
        D2HCopyError: one of those copies failed (raised after restoring).
        D2HTimeoutError: they did not finish in time (raised after restoring).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"uninstall(timeout_s=...) must be a number of seconds, got {timeout_s!r} "
                        f"({type(timeout_s).__name__})")
    if not timeout_s >= 0:  # also refuses NaN
        raise ValueError(f"uninstall(timeout_s=...) must be >= 0 seconds, got {timeout_s!r}")
    _host_writes.COPIES_FINISH_AT_CALL[0] = False
    _raw.COPY_ONLY_ENQUEUES[0] = False
    uninstall_all(timeout_s)


def is_installed() -> bool:
    """Return whether the shim is installed."""
    return is_shim_installed()


def stats() -> CopyStats:
    """Return a snapshot of the counters: staged, in place, offloaded, emulated waits, left alone by reason."""
    return COUNTERS.snapshot()


def reset_stats() -> None:
    """Zero the counters."""
    COUNTERS.reset()

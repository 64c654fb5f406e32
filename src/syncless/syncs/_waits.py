"""Explicit host waits that torch's debug mode does not report.

``torch.cuda.synchronize()`` and ``torch.cuda.Event.synchronize()`` block the
host (``cudaDeviceSynchronize``/``cudaEventSynchronize``) without passing
through torch's sync check, so the detector wraps them, and
``torch.cuda.Stream.synchronize()`` and ``torch.accelerator.synchronize()``
with them. A wrapper runs the wait inside an allow scope, so a wait that
torch does report is not reported twice, then reports it.

Not covered: the generic ``torch.Stream``/``torch.Event`` C types (they cannot
be patched in place), and raw driver calls.
"""

from __future__ import annotations

import functools
import sys

from syncless._core import patching
from syncless._core.compiling import is_compiling
from syncless.syncs import _report, _state

LAYER_KEY = "syncs"


def _targets() -> list[tuple[object, str, str]]:
    """(owner, attribute, how the user writes it) for every wait present in this torch."""
    import torch

    targets: list[tuple[object, str, str]] = [
        (torch.cuda, "synchronize", "torch.cuda.synchronize()"),
        (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize()"),
        (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize()"),
    ]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        targets.append((accelerator, "synchronize", "torch.accelerator.synchronize()"))
    return targets


def _make_wrapper(operation: str, beneath):
    # Takes and passes on exactly what the caller gave: torch reads the arguments, so its forms, defaults and
    # errors stay its own. The violation is handled after the wait returns, so a call torch refuses raises
    # torch's error and nothing else (in error mode the SyncViolation comes after the host waited).
    @functools.wraps(beneath)
    def wrapper(*args, **kwargs):
        # is_compiling() first: dynamo folds it to a constant, so tracing this
        # wrapper never reaches the ContextVar read.
        if is_compiling() or not _state.checked_depth.get() or not _state.is_violation_context():
            return beneath(*args, **kwargs)
        caller = sys._getframe(1)
        # Inside an allow scope, so that a wait torch's debug mode does report is not reported twice.
        token = _state.enter_allowed(None)
        try:
            result = beneath(*args, **kwargs)
        finally:
            _state.exit_allowed(token)
        violation = _report.locate(_report.KIND_WAIT, f"{operation} blocks the host until the GPU catches up",
                                   _report.FIX_WAIT, caller)
        if violation is not None:
            _report.handle(violation)
        return result

    return wrapper


def install() -> None:
    """Wrap the waits (idempotent)."""
    for owner, name, operation in _targets():
        patching.add_layer(owner, name, LAYER_KEY, patching.RANK_SYNC_DETECTOR, functools.partial(_make_wrapper, operation))


def uninstall() -> None:
    """Remove the wrappers; the originals come back by identity."""
    if "torch" not in sys.modules:
        return
    for owner, name, _ in _targets():
        patching.remove_layer(owner, name, LAYER_KEY)

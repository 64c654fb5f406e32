"""Event/stream/device synchronization that also covers offloaded D2H copies.

Each offloaded copy has a sequence number (:data:`._d2h.WORKER`). Recording
an event stamps it with the number of copies submitted so far; a
synchronize on that event waits for those copies too (and raises the first
failure among them), and a query says False while any is pending. Stream
and device synchronizes (and queries) cover every copy submitted before the
call, conservatively, on any D2H stream.

These host-side covers are what surface a failed copy (as
:class:`._worker.D2HCopyError`) at the synchronize that covers it. The
GPU-side ordering needs none of them: each offloaded copy gates its D2H
stream (see :mod:`._d2h`), so an event recorded on that stream, or on any
stream that waited for it, fires only after the copy, even if it is a C-made
``torch.Event`` these patches cannot see. Events are recorded where the
caller asked; nothing is redirected.

What is covered:
- ``torch.cuda.Event``: ``record``, ``synchronize``, ``query`` (all events,
  whenever they were created: the class's methods are patched).
- ``torch.cuda.Stream`` (and ``ExternalStream``): ``synchronize``, ``query``.
- ``torch.cuda.synchronize`` and ``torch.accelerator.synchronize`` (looked
  up through the module; a reference taken before ``install()`` is not
  covered).
- ``torch.Event``: a C type whose methods cannot be patched, so
  ``torch.Event`` is *replaced* by a subclass while installed. Only events
  created afterwards through ``torch.Event(...)`` are covered;
  ``torch.Stream.record_event()`` and other C code still make plain
  ``torch.Event`` objects, which are not covered, and events created before
  ``install()`` are not instances of the new ``torch.Event`` (``isinstance``
  is False for them until ``uninstall()``).
"""

from __future__ import annotations

from typing import Any

from syncless._core import patching
from syncless.cc._d2h import WORKER
from syncless.cc._layers import SHIM_KEY

_MARK = "_syncless_d2h_seq"


def _mark(event: Any) -> None:
    seq = WORKER.submitted
    if seq:
        try:
            setattr(event, _MARK, seq)
        except AttributeError:  # a C-made torch.Event has no __dict__: not covered (documented)
            pass


def _wait_marked(event: Any) -> None:
    seq = getattr(event, _MARK, 0)
    if seq:
        WORKER.wait_and_raise(seq)


def _cover_all() -> int:
    return WORKER.submitted


# torch.cuda.Event ------------------------------------------------------------------


def _wrap_event_record(next_record):
    def record(self, stream=None):
        _mark(self)
        return next_record(self, stream)

    return record


def _wrap_event_synchronize(next_sync):
    def synchronize(self):
        result = next_sync(self)
        _wait_marked(self)
        return result

    return synchronize


def _wrap_event_query(next_query):
    def query(self):
        if WORKER.is_pending(getattr(self, _MARK, 0)):
            return False
        return next_query(self)

    return query


# torch.cuda.Stream -------------------------------------------------------------------


def _wrap_stream_synchronize(next_sync):
    def synchronize(self):
        seq = _cover_all()
        result = next_sync(self)
        WORKER.wait_and_raise(seq)
        return result

    return synchronize


def _wrap_stream_query(next_query):
    def query(self):
        if WORKER.is_pending(WORKER.submitted):
            return False
        return next_query(self)

    return query


# device-wide -------------------------------------------------------------------------


def _wrap_device_synchronize(next_sync):
    def synchronize(device=None):
        seq = _cover_all()
        result = next_sync(device)
        WORKER.wait_and_raise(seq)
        return result

    return synchronize


# torch.Event -------------------------------------------------------------------------


def _wrap_torch_event(base):
    class Event(base):
        """``torch.Event`` whose record/synchronize/query also cover syncless's D2H copies."""

        def record(self, stream=None):
            _mark(self)
            return super().record(stream)

        def synchronize(self):
            result = super().synchronize()
            _wait_marked(self)
            return result

        def query(self):
            if WORKER.is_pending(getattr(self, _MARK, 0)):
                return False
            return super().query()

    Event.__module__ = base.__module__
    Event.__qualname__ = base.__qualname__
    return Event


def patch_targets() -> list[tuple[Any, str, Any]]:
    """Return ``(owner, attribute, wrapper)`` for every sync-related patch the shim installs."""
    import torch

    targets = [
        (torch.cuda.Event, "record", _wrap_event_record),
        (torch.cuda.Event, "synchronize", _wrap_event_synchronize),
        (torch.cuda.Event, "query", _wrap_event_query),
        (torch.cuda.Stream, "synchronize", _wrap_stream_synchronize),
        (torch.cuda.Stream, "query", _wrap_stream_query),
        (torch.cuda, "synchronize", _wrap_device_synchronize),
        (torch, "Event", _wrap_torch_event),
    ]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        targets.append((accelerator, "synchronize", _wrap_device_synchronize))
    return targets


def install_sync_patches() -> None:
    """Add the shim's layer to every synchronization entry point (idempotent per attribute)."""
    for owner, name, wrap in patch_targets():
        patching.add_layer(owner, name, SHIM_KEY, patching.RANK_CC_SHIM, wrap)


def uninstall_sync_patches() -> None:
    """Remove the shim's layer from every synchronization entry point."""
    for owner, name, _ in patch_targets():
        patching.remove_layer(owner, name, SHIM_KEY)

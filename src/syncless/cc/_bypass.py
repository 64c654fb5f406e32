"""Host<->device copies that do not go through ``Tensor.to/cuda/copy_``, ordered after a D2H stream's offloads.

torch runs ``h[:] = x`` (``Tensor.__setitem__``), ``x.new_tensor(h)``,
``torch.as_tensor(h, device=...)``, ``torch.asarray(h, device=...)`` and
``UntypedStorage.copy_`` through its C++ copy, on the current stream, without calling the patched ``Tensor.copy_``.
Issued while a D2H stream ``D`` is current, torch orders such a copy after
the copies queued on ``D`` before it; an offloaded copy is not on ``D``::

    torch     D : [h.copy_(a)] [h[:] = b]                   -> h is b
    the shim  D : [snap a]     [h[:] = b]   worker: a -> h  -> h is a (issue 27 item 1)

So each of these, while an offloaded copy is pending and a D2H stream is
current, first waits on the host for that stream's offloaded copies (as a
copy through the wrappers does: :func:`._shim._settle_d2h_stream`), and
counts the wait in ``cc.stats().bypass_waits``. ``h[:] = b`` waits only when
it moves bytes between host and GPU (one side CUDA, the other not): a
``__setitem__`` runs on every indexed assignment, so the check is two
attribute reads, and nothing while no offloaded copy is pending. Copies that
no Python entry point fronts (``torch.ops.aten.copy_``, ``torch._foreach_copy_``,
C++ extensions) are not seen: docs/cc.md, "Limits".
"""

from __future__ import annotations

from typing import Any

from syncless._core.compiling import is_compiling
from syncless.cc import _d2h, _streams
from syncless.cc._stats import COUNTERS


def settle_current_d2h_streams() -> None:
    """Wait on the host for the offloaded copies of every D2H stream that is current on its GPU now.

    Blocks the host only while such copies are pending. Raises the first failure among them that this thread
    has not had yet (``D2HCopyError``).
    """
    if not _d2h.busy():
        return
    for index in {key[0] for key in list(_d2h._streams_by_key)}:
        record = _d2h.lookup(_streams.current_stream(index))
        # A failure kept is raised whether or not its copy has finished (found in review: once a failed copy had
        # ended, these calls returned without it, and the program read the buffer it never wrote).
        if record is None:
            continue
        if record.worker.is_pending(record.last_job):
            COUNTERS.add("bypass_waits")
            _d2h.wait_for_stream(record)
        elif _d2h.UNRAISED[0]:
            _d2h.wait_for_stream(record)  # waits for nothing: raises a failure this thread has not had


def _crosses(a: Any, b: Any) -> bool:
    """Whether ``a[...] = b`` copies between host and GPU (one of the two a CUDA tensor, the other a CPU one)."""
    import torch

    if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor):
        return False
    return a.is_cuda != b.is_cuda


def _wrap_setitem(next_setitem):
    def __setitem__(*args, **kwargs):
        # The hot path: two integer reads while no offloaded copy is pending and no failure is kept (inline),
        # after is_compiling(), which dynamo folds to a constant: read first, the count was a guard, and each change
        # of it recompiled the frame until it fell back to eager (issue 33 item 1).
        if (not is_compiling() and (_d2h._PENDING[0] or _d2h.UNRAISED[0]) and len(args) == 3
                and _crosses(args[0], args[2])):
            settle_current_d2h_streams()
        return next_setitem(*args, **kwargs)

    return __setitem__


def _wrap_settling(next_fn):
    """``new_tensor``, ``as_tensor``, ``asarray``, ``UntypedStorage.copy_``: rare enough to settle whenever a copy is
    pending or a failure is kept."""

    def settling(*args, **kwargs):
        if not is_compiling() and (_d2h._PENDING[0] or _d2h.UNRAISED[0]):  # is_compiling() first: see _wrap_setitem
            settle_current_d2h_streams()
        return next_fn(*args, **kwargs)

    return settling


def patch_targets() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, wrapper)`` of each entry point fronted here."""
    import torch

    return [
        (torch.Tensor, "__setitem__", _wrap_setitem),
        (torch.Tensor, "new_tensor", _wrap_settling),
        (torch, "as_tensor", _wrap_settling),
        (torch, "asarray", _wrap_settling),  # copies in C++ as as_tensor does (found in review)
        (torch.UntypedStorage, "copy_", _wrap_settling),
    ]

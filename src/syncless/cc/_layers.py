"""What the CC shim's and the CC emulator's layers over torch share: their keys, and how they read a call.

The layers are named in :mod:`syncless._core.patching` by :data:`SHIM_KEY`
and :data:`EMULATION_KEY`. Every wrapper takes ``*args, **kwargs`` and passes
them on untouched, so torch parses every call itself: its forms, defaults,
errors (type and message) and deprecation warnings stay its own
(docs/cc.md, "Calling conventions"). A wrapper reads a call only to decide
what to do with it, through the readers of :mod:`syncless._core.tensor_calls`,
which understand torch's own forms and nothing else; a form they do not
understand goes on as given, so torch accepts or refuses it. A call that
torch hands to a ``__torch_function__`` override (a tensor subclass's, or a
mode) goes on unread as well (:func:`call_for_routing`): the override then
sees exactly what it sees without syncless, and the call it makes back into
torch (overrides disabled) is the one routed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from syncless._core.tensor_calls import dispatch_modes, functorch_active, has_override

SHIM_KEY = "cc.shim"
EMULATION_KEY = "cc.emulation"
TENSOR_ATTRS = ("to", "cuda", "copy_")
# Tensor methods that block the host until the tensor's stream is done (a device-to-host read), which the
# shim only fronts to let a D2H stream's offloaded copies finish first (docs/cc.md).
SYNCING_ATTRS = ("cpu", "item", "tolist")


def call_for_waiting(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a wrapper may read a ``Tensor.to/cuda/copy_``-like call's devices to wait around it (the emulator's
    wait after a copy, the shim's wait for offloaded copies before one): its first argument is a tensor and no
    ``__torch_function__`` override takes the call.

    Wider than :func:`call_for_routing`: an override's call back into torch comes through the wrapper again (and
    waits then), but a call under a ``TorchDispatchMode`` or a functorch transform, or of a ``__torch_dispatch__``
    tensor, never does, and its copy is as real (found in review: such copies were never waited for). The wait
    reads the tensors' devices and no data, and runs no op a mode would see.
    """
    import torch

    return bool(args) and isinstance(args[0], torch.Tensor) and not has_override(args, kwargs)


def call_for_routing(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, tuple] | None:
    """Return ``(tensor, the other arguments)`` of a ``Tensor.to/cuda/copy_`` call a wrapper may read, else None.

    None when the call has no tensor first (torch refuses it: ``Tensor.to()``,
    ``Tensor.to(self=x)``, ``Tensor.copy_(1, y)``), when torch hands it to
    a ``__torch_function__`` override, while a ``TorchDispatchMode`` or a
    functorch transform (``vmap``, ``grad``) is active, or when a tensor in it handles calls
    in ``__torch_dispatch__``: torch.compile's fake and functional tensors
    (no memory to stage; tracing code must not touch data pointers) and
    other dispatch subclasses, which see the copy themselves. Reads no
    tensor attribute.
    """
    import torch

    tensor = torch.Tensor
    if not args or not isinstance(args[0], tensor) or has_override(args, kwargs):
        return None
    if dispatch_modes() or functorch_active(args):
        # A TorchDispatchMode would see the shim's own ops (events, record_stream, staging copies); a functorch
        # transform has no batching rule for them: the call goes on as torch's own.
        return None
    plain_dispatch = tensor.__torch_dispatch__
    for values in (args, kwargs.values()):
        for value in values:
            kind = type(value)
            if kind is not tensor and isinstance(value, tensor) and kind.__torch_dispatch__ is not plain_dispatch:
                return None
    return args[0], args[1:]

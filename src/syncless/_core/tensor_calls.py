"""Reading the arguments of a ``Tensor.to`` call the way torch does (shared by ``syncs`` and ``cc``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def maybe_non_blocking_to(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Cheap pre-check for ``Tensor.to``: can this call carry ``non_blocking=True`` at all?

    ``args`` excludes the tensor. ``non_blocking`` is either a keyword or the
    2nd/3rd positional argument (``to(dtype, non_blocking)``,
    ``to(other, non_blocking)``, ``to(device, dtype, non_blocking)``); a
    single positional argument never is.
    """
    if kwargs.get("non_blocking"):
        return True
    return len(args) >= 2 and any(a is True for a in args[1:3])


def parse_to(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any, bool, Any]:
    """Return ``(device, dtype, non_blocking, memory_format)`` of a ``Tensor.to`` call, as torch parses it.

    ``args`` excludes the tensor. ``copy`` is left out, as a keyword or in its
    position (``to(device, dtype, non_blocking, copy)``, ``to(dtype,
    non_blocking, copy)``, ``to(other, non_blocking, copy)``): torch's parser
    refuses it, and it does not change where the data goes. Raises what
    torch's parser raises for a call it would reject (``TypeError``, or
    ``RuntimeError`` for a device it cannot read); callers that only inspect
    a call catch those and pass the call on, so torch raises its own error.
    """
    import torch

    if "copy" in kwargs:
        kwargs = {key: value for key, value in kwargs.items() if key != "copy"}
    if len(args) == 4 or (len(args) == 3 and isinstance(args[0], (torch.dtype, torch.Tensor))):
        args = args[:-1]  # the positional copy
    return torch._C._nn._parse_to(*args, **kwargs)

"""Reading the arguments of a ``Tensor.to`` call the way torch does (shared by ``syncs`` and ``cc``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def maybe_non_blocking_to(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Cheap pre-check for ``Tensor.to``: can this call carry ``non_blocking=True`` at all?

    ``non_blocking`` is either a keyword or the 2nd/3rd positional argument
    (``to(dtype, non_blocking)``, ``to(other, non_blocking)``,
    ``to(device, dtype, non_blocking)``); a single positional argument never is.
    """
    if kwargs.get("non_blocking"):
        return True
    return len(args) >= 2 and any(a is True for a in args[1:3])


def parse_to(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any, bool, Any]:
    """Return ``(device, dtype, non_blocking, memory_format)`` of a ``Tensor.to`` call, as torch parses it.

    ``copy=`` is left out (torch's parser refuses it, and it does not change
    where the data goes). Raises what torch raises for a call it would reject.
    """
    import torch

    if "copy" in kwargs:
        kwargs = {key: value for key, value in kwargs.items() if key != "copy"}
    return torch._C._nn._parse_to(*args, **kwargs)

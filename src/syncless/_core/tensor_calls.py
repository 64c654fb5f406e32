"""Reading the arguments of ``Tensor.to/cuda/copy_`` calls the way torch does (shared by ``syncs`` and ``cc``)."""

from __future__ import annotations

import functools
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


_COPY_KEYWORDS = frozenset(("other", "non_blocking"))
_CUDA_KEYWORDS = frozenset(("device", "non_blocking", "memory_format"))


def read_copy(args: Sequence[Any], kwargs: Mapping[str, Any], *,
              deprecated_async: bool = False) -> tuple[Any, bool] | None:
    """Return ``(other, non_blocking)`` of a ``Tensor.copy_`` call in torch's own form, else None.

    ``args`` excludes the destination. torch's signature is ``copy_(other,
    non_blocking=False)`` with a bool ``non_blocking``; any other form (a
    repeated, missing or unknown argument, a non-bool ``non_blocking``) gives
    None, and so does the deprecated ``async=`` unless ``deprecated_async``
    (for a call torch has already accepted: ``async`` then stands for
    ``non_blocking``). A caller passes a None call on untouched, so torch
    accepts or refuses it itself. Reads no tensor attribute.
    """
    if not kwargs:  # the common forms, read first
        if len(args) == 1:
            return args[0], False
        return (args[0], args[1]) if len(args) == 2 and type(args[1]) is bool else None
    keywords = _COPY_KEYWORDS | {"async"} if deprecated_async else _COPY_KEYWORDS
    if len(args) > 2 or not kwargs.keys() <= keywords or ("async" in kwargs and "non_blocking" in kwargs):
        return None
    given_twice = (len(args) >= 1 and "other" in kwargs) or (
        len(args) == 2 and bool(kwargs.keys() & {"non_blocking", "async"}))
    if given_twice or not (args or "other" in kwargs):
        return None
    other = args[0] if args else kwargs["other"]
    non_blocking = args[1] if len(args) == 2 else kwargs.get("non_blocking", kwargs.get("async", False))
    if type(non_blocking) is not bool:
        return None
    return other, non_blocking


def read_cuda(args: Sequence[Any], kwargs: Mapping[str, Any], *,
              deprecated_async: bool = False) -> tuple[Any, bool, Any] | None:
    """Return ``(device, non_blocking, memory_format)`` of a ``Tensor.cuda`` call in torch's own form, else None.

    ``args`` excludes the tensor. torch's signature is ``cuda(device=None,
    non_blocking=False, *, memory_format=torch.preserve_format)`` with a bool
    ``non_blocking``; ``device`` and ``memory_format`` are returned as given
    (None when left out), not checked. Any other form gives None, as in
    :func:`read_copy` (``deprecated_async`` too). Reads no tensor attribute.
    """
    keywords = _CUDA_KEYWORDS | {"async"} if deprecated_async else _CUDA_KEYWORDS
    if len(args) > 2 or not kwargs.keys() <= keywords or ("async" in kwargs and "non_blocking" in kwargs):
        return None
    if (len(args) >= 1 and "device" in kwargs) or (len(args) == 2 and kwargs.keys() & {"non_blocking", "async"}):
        return None
    non_blocking = args[1] if len(args) == 2 else kwargs.get("non_blocking", kwargs.get("async", False))
    if type(non_blocking) is not bool:
        return None
    return (args[0] if args else kwargs.get("device")), non_blocking, kwargs.get("memory_format")


def reads_as_cuda_device(device: Any) -> bool:
    """Whether torch reads ``device`` as a CUDA device in ``Tensor.cuda(device)`` (None: the current one)."""
    import torch

    if device is None or (type(device) is int and device >= 0):
        return True
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            return False
    return isinstance(device, torch.device) and device.type == "cuda"


class _TorchChecks:
    """torch's C entry points the checks below call on every routed copy, looked up once (None: this torch lacks it).

    Each check is then one call, not a chain of attribute lookups: these run on the host path of every
    ``non_blocking`` copy, where a microsecond shows (docs/cc.md, "The shim's own cost").
    """

    __slots__ = ("tensor", "plain_types", "has_torch_function", "has_torch_function_unary", "dispatch_stack_len",
                 "functorch_peek", "functorch_wrapped")

    def __init__(self) -> None:
        import torch

        functorch = getattr(torch._C, "_functorch", None)
        self.tensor = torch.Tensor
        # Values that never carry an override of their own: torch's check skips them (or finds nothing).
        self.plain_types = (str, int, float, bool, type(None), torch.device, torch.dtype, torch.memory_format)
        self.has_torch_function = torch._C._has_torch_function
        self.has_torch_function_unary = torch._C._has_torch_function_unary
        self.dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None)
        self.functorch_peek = getattr(functorch, "peek_interpreter_stack", None)
        self.functorch_wrapped = getattr(functorch, "is_functorch_wrapped_tensor", None)


@functools.cache
def _torch_checks() -> _TorchChecks:
    return _TorchChecks()


def has_override(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether torch would hand this call to a ``__torch_function__`` override (a tensor subclass's, or a mode).

    A wrapper that sees True passes the call on untouched and reads nothing
    (reading a subclass's attributes would itself call its override); torch
    then calls the override, which calls the wrapper again with overrides
    disabled, and that call is read and routed as usual.
    """
    checks = _torch_checks()
    check, tensor, plain = checks.has_torch_function_unary, checks.tensor, checks.plain_types
    if not args or not isinstance(args[0], tensor):
        whole = checks.has_torch_function
        return whole(args) or (bool(kwargs) and whole(tuple(kwargs.values())))
    # Argument by argument, the answer of torch's check of the whole call (the active modes, or any argument
    # with an override of its own: a tensor subclass, or a tensor-like object torch's parser takes in a tensor's
    # place), without its slow look-up on the plain values a copy call carries (a device, a dtype, a bool).
    if check(args[0]):
        return True
    for values in (args[1:], kwargs.values()):
        for value in values:
            if not isinstance(value, plain) and check(value):
                return True
    return False


def dispatch_modes() -> int:
    """How many ``TorchDispatchMode``s are active (0 where torch cannot say)."""
    count = _torch_checks().dispatch_stack_len
    return count() if count is not None else 0


def functorch_active(tensors: Sequence[Any]) -> bool:
    """Whether a functorch transform (``vmap``, ``grad``, ...) is running or wraps one of ``tensors``.

    Such wrappers have no batching rule for most of what a wrapper would do to read or reroute a copy
    (``is_pinned``, ``record_stream``), so both syncs and cc pass the call on unread.
    """
    checks = _torch_checks()
    peek = checks.functorch_peek
    if peek is not None and peek() is not None:
        return True
    wrapped = checks.functorch_wrapped
    if wrapped is None:
        return False
    tensor = checks.tensor
    for t in tensors:
        if isinstance(t, tensor) and wrapped(t):
            return True
    return False

"""What the CC shim's and the CC emulator's layers over torch share: their keys and torch's call forms.

The layers are named in :mod:`syncless._core.patching` by :data:`SHIM_KEY`
and :data:`EMULATION_KEY`. Their ``Tensor.copy_``/``Tensor.cuda`` wrappers
take torch's own signatures, which its argument parser defines as::

    copy_(Tensor other, bool non_blocking=False)         (deprecated: async= for non_blocking=)
    cuda(Device? device=None, bool non_blocking=False, *, MemoryFormat? memory_format=None)
                                                         (deprecated: async= for non_blocking=)

so that reading a call costs nothing. Their defaults are :data:`UNSET`
rather than torch's: an argument the caller left out stays out of the call
passed on (torch refuses ``non_blocking`` next to the deprecated ``async``,
and its error messages depend on what was passed). Anything else torch may
accept or refuse (``async=``, a typo, one argument too many, a
``non_blocking`` that is not a bool) reaches torch as it was given, through
:func:`forward_copy` and :func:`forward_cuda`, so torch raises its own
error. Two differences in the text, not the type, of such an error: a call
Python cannot bind to these signatures (the same argument given twice) gets
Python's ``TypeError``, which names the wrapper; and a bad ``non_blocking=``
given with ``other`` reaches torch positionally, so its message names the
position.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

SHIM_KEY = "cc.shim"
EMULATION_KEY = "cc.emulation"
TENSOR_ATTRS = ("to", "cuda", "copy_")


class _Unset:
    """The type of :data:`UNSET`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<not given>"


UNSET: Any = _Unset()
"""Default of an argument the caller may leave out; test it with ``is``."""


def forward_copy(next_copy: Callable[..., Any], dst: Any, other: Any, non_blocking: Any, args: tuple,
                 kwargs: Mapping[str, Any]) -> Any:
    """Call ``next_copy`` with the arguments of a ``dst.copy_(...)`` call, leaving out the ones not given."""
    if non_blocking is UNSET:  # then nothing positional came after ``other``
        return next_copy(dst, **kwargs) if other is UNSET else next_copy(dst, other, **kwargs)
    if other is UNSET:
        return next_copy(dst, non_blocking=non_blocking, **kwargs)
    return next_copy(dst, other, non_blocking, *args, **kwargs)


def forward_cuda(next_cuda: Callable[..., Any], src: Any, device: Any, non_blocking: Any, args: tuple,
                 memory_format: Any, kwargs: Mapping[str, Any]) -> Any:
    """Call ``next_cuda`` with the arguments of a ``src.cuda(...)`` call, leaving out the ones not given."""
    if memory_format is not UNSET:
        kwargs = {**kwargs, "memory_format": memory_format}
    if device is UNSET:  # then nothing positional was given
        if non_blocking is not UNSET:
            kwargs = {**kwargs, "non_blocking": non_blocking}
        return next_cuda(src, **kwargs)
    if non_blocking is UNSET:
        return next_cuda(src, device, **kwargs)
    return next_cuda(src, device, non_blocking, *args, **kwargs)

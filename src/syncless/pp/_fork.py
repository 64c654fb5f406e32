"""After ``fork()``, a copy-engine transport is marked unusable in the child.

A transport cannot be used in a forked child (CUDA does not survive a fork,
and its memory and sockets are the parent's): the transports registered with
:func:`forget_in_child` are marked failed there, and release nothing. The
child's copies of the metadata sockets are closed by ``_meta_channel``'s own
fork hook (a peer learns that a stage died from its socket closing, which a
child's copy would prevent).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

_transports: weakref.WeakSet[Any] = weakref.WeakSet()


def forget_in_child(transport: Any) -> None:
    """Register ``transport`` (with ``_forked()``): a forked child marks it unusable."""
    _transports.add(transport)


def _after_fork_in_child() -> None:
    for transport in list(_transports):
        transport._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

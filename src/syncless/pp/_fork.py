"""After ``fork()``, the child closes its copies of every metadata socket of the copy-engine transport.

A peer learns that a stage died from its metadata socket closing (``_meta_channel``).
A forked child would hold a copy of the dead parent's socket, so the peer would
see nothing until the timeout. Python sockets are already close-on-exec
(PEP 446), which covers ``fork`` + ``exec`` (``subprocess``); this covers a fork
that does not exec (``multiprocessing``'s ``fork`` start method, a data loader
worker). Closing the child's copy leaves the parent's socket open.

A transport cannot be used in the child anyway (CUDA does not survive a
fork); the transports registered with :func:`forget_in_child` are marked
failed there.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

_endpoints: weakref.WeakSet[Any] = weakref.WeakSet()
_transports: weakref.WeakSet[Any] = weakref.WeakSet()


def close_in_child(endpoint: Any) -> None:
    """Register ``endpoint`` (anything with ``close()``): a forked child closes it at once."""
    _endpoints.add(endpoint)


def forget_in_child(transport: Any) -> None:
    """Register ``transport`` (with ``_forked()``): a forked child marks it unusable."""
    _transports.add(transport)


def _after_fork_in_child() -> None:
    for endpoint in list(_endpoints):
        with contextlib.suppress(OSError):
            endpoint.close()
    for transport in list(_transports):
        transport._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

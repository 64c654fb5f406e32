"""Host waits that syncless makes where the driver itself would wait, so that no detector counts them.

Under Confidential Computing the driver blocks a host<->device copy until
its stream drains. The CC emulator reproduces that with a driver wait, and
the CC shim waits for its staging stream instead (the transfer alone);
both stand for the driver's own behaviour, not for the user's code
(docs/cc.md). The hidden-sync detector's CUPTI layer sees every driver call
that blocks, so ``syncless.cc`` marks those waits with
:func:`standing_for_the_driver` and ``syncless.syncs`` skips calls made
while :func:`is_standing_for_the_driver` is true on the calling thread.
Plain Python, per thread; costs one attribute read to ask.
"""

from __future__ import annotations

import threading

_local = threading.local()
# The per-thread mark itself: ``depth`` above 0 while a thread stands for the driver. A hot wait (the CC emulator's,
# once per copy) raises and restores it inline rather than through the context manager's two calls.
MARKS = _local


class _StandingForTheDriver:
    """The context manager :func:`standing_for_the_driver` returns (a class: cheaper than a generator on hot paths)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc_info: object) -> None:
        _local.depth -= 1


_MARK = _StandingForTheDriver()


def standing_for_the_driver() -> _StandingForTheDriver:
    """Mark the calling thread's CUDA calls in the block as waits the driver would make itself (they nest)."""
    return _MARK


def is_standing_for_the_driver() -> bool:
    """Return whether the calling thread is inside :func:`standing_for_the_driver`."""
    return getattr(_local, "depth", 0) > 0

"""The probes' shared timer: median host time of one call, each sample from a drained GPU (imported by the probes)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_host_us(torch: Any, dev: Any, fn: Callable[[], Any], repeats: int,
                   before: Callable[[], Any] | None = None) -> float:
    """Median over ``repeats`` of the host time (us) ``fn()`` takes.

    Each sample: synchronize ``dev``, run ``before`` (queue GPU work, idle the host, ...) untimed, time ``fn``,
    synchronize again and drop its result.
    """
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(dev)
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize(dev)
        del out
    return statistics.median(times)

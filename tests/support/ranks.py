"""The tests' defaults for :func:`syncless._core.launch.run_ranks`.

    from support.ranks import run_ranks, say

    def body(rank, world_size, steps):       # module level, in any test file
        say(f"step {i}")                       # "[rank 1 +2.3s] step 4", flushed at once
        return something_picklable

    results = run_ranks(body, 2, args=(100,), backend="gloo", timeout_s=60)

Test functions are found again in each rank by their file and qualified
name (pytest's importlib mode gives test modules no importable name); the
ranks meet through a temporary file, print progress, and the whole run has
a hard timeout (120 s unless given). See the core launcher for the rest
(``devices``, ``may_die``, the errors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from syncless._core.launch import RankFailed, RanksTimedOut, say
from syncless._core.launch import run_ranks as _run_ranks

__all__ = ["RankFailed", "RanksTimedOut", "run_ranks", "say"]


def run_ranks(fn: Callable[..., Any], world_size: int, **options: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks with the tests' defaults; see above."""
    options.setdefault("init", "file")
    options.setdefault("timeout_s", 120.0)
    return _run_ranks(fn, world_size, load_by_file=True, progress=True, **options)

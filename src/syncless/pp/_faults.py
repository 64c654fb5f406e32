"""Test-only fault injection: named points in set-up, steps and tear-down where a test may act.

The fault-table harness (``tests/multi_gpu/pp/fault_table.py``) installs a
hook that kills, interrupts or stalls its own process when it reaches one of
:data:`PHASES`. Without a hook (always, outside tests) each point costs one
module attribute load and a comparison with None.
"""

from __future__ import annotations

from collections.abc import Callable

#: Every named point, in the order a transport's life reaches them.
PHASES = (
    "setup:layout",  # make_transport, before the stages agree on layouts and depth
    "setup:check",  # copy-engine set-up step 1 (local checks)
    "setup:allocate",  # step 2 (topology, allocate and export the buffer)
    "setup:open",  # step 3 (map the neighbours, connect the metadata socket)
    "setup:accept",  # step 4 (accept the previous stage's metadata connection)
    "step:before_meta",  # send(): the step's data is enqueued (or cloned), its metadata not yet sent
    "step:after_meta",  # send(): the step's metadata went out
    "close",  # close(): own work finished, before the barrier with the other stages
)

#: The installed hook, called as ``hook(phase)``; None outside tests.
hook: Callable[[str], None] | None = None


def install(fn: Callable[[str], None] | None) -> None:
    """Install ``fn`` as the hook (None removes it)."""
    global hook
    hook = fn


def reach(phase: str) -> None:
    """Call the hook, if any, for ``phase`` (one of :data:`PHASES`)."""
    if hook is not None:
        hook(phase)

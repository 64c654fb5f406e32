"""A server's checked loop: 100,000 steps, each with a sync, in record mode, in bounded memory.

On the CPU fakes (torch's warning issued by hand, the fake debug-mode
switch) and on the CUPTI stand-in. The resident memory is measured after a
warm-up and again at the end; the report must give one site with every step
counted. Each test prints what it measured (``-s`` shows it).
"""

from __future__ import annotations

import collections
import os
import sys

from syncless import syncs
from syncless.syncs import _debugmode

from . import fake_cupti as fake
from .conftest import torch_sync_warning
from .test_cupti_backend import cupti_env, enabled  # noqa: F401 - the fixture

STEPS = 100_000
WARM_UP = 1_000
# What the process may grow by over the steps: flat, whatever their number. (Holding one formatted stack
# per sync, as CUPTI's held-back events did, is ~1 KB a step: 100 MB here.)
MEMORY_LIMIT = 4 * 1024 * 1024


def _resident_bytes() -> int:
    """The process's resident memory now (Linux's /proc; the peak where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run(step, label: str) -> int:
    """Run ``step`` WARM_UP + STEPS times; return the line it syncs on. Fails if the process grew."""
    _debugmode.backend().history = collections.deque(maxlen=8)  # the fake's own log of levels, not ours
    for _ in range(WARM_UP):
        line = step()
    start = _resident_bytes()
    middle = None
    for index in range(STEPS):
        step()
        if index == STEPS // 10:
            middle = _resident_bytes()
    end = _resident_bytes()
    print(f"\n{label}: {STEPS} steps; resident memory {start / 2**20:.1f} MiB after the warm-up, "
          f"{middle / 2**20:.1f} MiB at step {STEPS // 10}, {end / 2**20:.1f} MiB at the end "
          f"({end - start:+d} bytes)")
    assert end - start < MEMORY_LIMIT, (start, middle, end)
    return line


def _one_site(line: int) -> None:
    found = syncs.report()
    rows = [(s.first.filename, s.first.lineno, s.count) for s in found.sites]
    assert rows == [(__file__, line, STEPS + WARM_UP)], found.format()


def test_torch_layer_a_checked_step_per_iteration(fake_mode):
    @syncs.checked
    def step():
        line = sys._getframe().f_lineno + 1
        torch_sync_warning()
        return line

    _one_site(_run(step, "torch layer, @checked step"))


def test_cupti_layer_one_long_region(cupti_env):
    enabled(cupti_env)

    def step():
        line = sys._getframe().f_lineno + 1
        fake.call("cuStreamSynchronize", [0])
        return line

    with syncs.checking():
        line = _run(step, "CUPTI layer, one region around the loop")
    _one_site(line)


def test_cupti_layer_a_checked_step_per_iteration(cupti_env):
    enabled(cupti_env)

    @syncs.checked
    def step():
        line = sys._getframe().f_lineno + 1
        fake.torch_op([("cudaStreamSynchronize", [0])])  # torch and CUPTI see it: merged into one sync
        return line

    _one_site(_run(step, "torch + CUPTI layers, @checked step"))

"""On a real GPU with the CUPTI backend: regions in tasks/threads started from a region, and long regions.

Each sync is a raw driver wait through cuda-bindings (only CUPTI sees it).
"""

from __future__ import annotations

import asyncio
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from syncless import syncs
from syncless.syncs import _report

from .cupti_fixtures import cupti_detector, rows_at  # noqa: F401 - fixtures used by name

HERE = Path(__file__).name


@pytest.fixture
def stream_sync(cuda_device):
    """A raw cuStreamSynchronize on torch's current stream; returns the line it is made on."""
    from cuda.bindings import driver

    torch.zeros(1, device=cuda_device)  # makes torch's primary context current on this thread
    err, context = driver.cuCtxGetCurrent()
    assert err == driver.CUresult.CUDA_SUCCESS, err
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)

    def sync() -> int:
        driver.cuCtxSetCurrent(context)  # a thread started from the test has no current context of its own
        line = sys._getframe().f_lineno + 1
        (err,) = driver.cuStreamSynchronize(stream)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        return line

    return sync


@pytest.mark.gpu
def test_a_region_in_a_thread_started_from_a_region_records_its_cupti_syncs(cupti_detector, stream_sync):  # noqa: F811
    lines = []

    @syncs.checked
    def in_the_thread():
        lines.append(stream_sync())

    async def main():
        with syncs.checking():
            await asyncio.to_thread(in_the_thread)

    asyncio.run(main())
    found = syncs.report()
    rows = rows_at(found, HERE, lines[0])
    assert len(rows) == 1 and rows[0].count == 1 and rows[0].layers == ("cupti",), found.format()


@pytest.mark.gpu
def test_a_long_region_stays_bounded_and_counts_every_sync(cupti_detector, stream_sync):  # noqa: F811
    steps = 20_000
    with syncs.checking():
        for _ in range(200):
            stream_sync()
        tracemalloc.start()
        grown = []  # per half: one-off growth (caches, buffers) lands in the first; a per-sync cost in both
        for _ in range(2):
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(steps // 2):
                line = stream_sync()
            grown.append(tracemalloc.get_traced_memory()[0] - before)
        tracemalloc.stop()
        events = _report.region_events.get()
        assert len(events.pending) == 1, len(events.pending)
    print(f"{steps} CUPTI-only syncs in one region: traced memory grew by {grown[0]} then {grown[1]} bytes "
          f"per {steps // 2} syncs")
    # The old code kept a formatted stack per sync (about 1.2 KB each: 12 MB per half); flat is far below that.
    assert grown[1] < 64 * 1024, grown
    found = syncs.report()
    rows = rows_at(found, HERE, line)
    assert len(rows) == 1 and rows[0].count == steps + 200, found.format()

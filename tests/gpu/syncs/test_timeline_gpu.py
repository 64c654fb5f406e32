"""The syncs on a timeline on a real GPU, with both backends: torch.profiler ranges, the trace JSON, the picture.

An ``.item()`` behind ~25 ms of queued GPU work (``torch.cuda._sleep``,
calibrated first) must show in the profiler's trace at the user's line, on
the thread that blocked:

* CUPTI backend: as a range of at least 15 ms (opened around the blocking
  CUDA call itself); a raw ``cuStreamSynchronize`` through ctypes too;
* torch backend: as a marker right after torch's own ``aten::item`` range,
  which holds the blocked time (torch reports the sync after it returned;
  ``docs/syncs.md``, "On the timeline").

With ``SYNCLESS_GPU_ARTIFACTS=DIR`` each test saves the profiler's trace, the
detector's trace and the picture there (the lead commits them under
``bench/results/``); ``test_the_picture_for_the_docs`` draws the one in
``docs/syncs.md``.

The profiler records CPU activities only: with the CUPTI backend the
detector holds CUPTI, and the profiler's CUDA activities would be lost.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from syncless import syncs
from syncless.syncs import _backend, _timeline

from .cupti_fixtures import require_cupti

HERE = Path(__file__).name
QUEUED_MS = 25.0
AT_LEAST_US = 15_000


def here() -> int:
    """The line number of the caller's next line."""
    return sys._getframe(1).f_lineno + 1


def artifacts(tmp_path: Path) -> Path:
    """Where to save what a test made: ``SYNCLESS_GPU_ARTIFACTS`` if set, else the test's tmp_path."""
    folder = os.environ.get("SYNCLESS_GPU_ARTIFACTS")
    path = Path(folder) if folder else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


_cycles_per_ms: list[float] = []


def queue_gpu_work(ms: float) -> None:
    """Queue about ``ms`` milliseconds of GPU work on the current stream (calibrated once)."""
    if not _cycles_per_ms:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _cycles_per_ms.append(20_000_000 / start.elapsed_time(end))
    torch.cuda._sleep(int(_cycles_per_ms[0] * ms))


@contextlib.contextmanager
def detector(backend: str):
    """The detector in record mode with ``backend``, the timeline recorded; everything put back after."""
    mode_before, backend_before = syncs.mode(), _backend.backend.requested
    if syncs.is_enabled():
        syncs.disable()
    syncs.set_mode("record")
    syncs.set_backend(backend)
    syncs.reset()
    syncs.record_timeline(True)
    queue_gpu_work(0)  # calibrates, before enable(): its event wait is not the test's
    torch.cuda.synchronize()
    assert syncs.enable(), "the detector must be active on a GPU machine"
    try:
        with syncs.checking():
            pass  # the first region takes CUPTI (cupti backend) before any profiler starts
        yield
        assert syncs.backend_choice().active == backend, syncs.backend_choice()
    finally:
        syncs.disable()
        syncs.record_timeline(False)
        syncs.reset()
        syncs.set_backend(backend_before)
        syncs.set_mode(mode_before)


@pytest.fixture(params=["torch", "cupti"])
def backend(request, cuda_device):
    if request.param == "cupti":
        require_cupti()
    with detector(request.param):
        yield request.param


def save(prof, name: str, tmp_path: Path) -> list[dict]:
    """Save the profiler's trace, the detector's trace and picture; return the profiler's complete events."""
    folder = artifacts(tmp_path)
    profiler_path = folder / f"{name}-profiler.json"
    prof.export_chrome_trace(str(profiler_path))
    found = syncs.report()
    found.to_chrome_trace(folder / f"{name}-syncless.json")
    found.plot(folder / f"{name}-syncless.png")
    assert (folder / f"{name}-syncless.png").stat().st_size > 0
    with open(profiler_path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def ranges_at(events: list[dict], line: int) -> list[dict]:
    return [e for e in events if e["name"].startswith(f"{_timeline.SYNC_PREFIX} {HERE}:{line} ")]


@pytest.mark.gpu
def test_an_item_behind_queued_work_is_a_range_at_the_users_line(backend, cuda_device, tmp_path):
    x = torch.randn(1 << 20, device=cuda_device)
    x.sum().item()  # warm up outside any region
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with syncs.checking():
            queue_gpu_work(QUEUED_MS)
            line = here()
            value = x.sum().item()
    assert isinstance(value, float)
    events = save(prof, f"item-{backend}", tmp_path)
    ours = ranges_at(events, line)
    assert ours, [e["name"] for e in events]
    assert all(e["tid"] == threading.get_native_id() for e in ours)
    assert all("test_an_item_behind_queued_work_is_a_range_at_the_users_line" in e["name"] for e in ours)
    longest = max(e["dur"] for e in ours)
    print(f"{backend}: {len(ours)} range(s) at line {line}, longest {longest:.1f} us")
    if backend == "cupti":
        assert longest >= AT_LEAST_US, ours
    else:
        # The marker follows torch's own range of the op, which holds the blocked time.
        items = [e for e in events if e["name"] == "aten::item" and e["tid"] == threading.get_native_id()]
        assert items and max(e["dur"] for e in items) >= AT_LEAST_US, items
        item = max(items, key=lambda e: e["dur"])
        assert ours[0]["ts"] >= item["ts"] + item["dur"] - 1, (ours[0], item)
    (sync,) = [s for s in syncs.report().timeline.syncs if s.lineno == line]
    if backend == "cupti":
        assert sync.timed and sync.blocked_ns >= AT_LEAST_US * 1000 and "cupti" in sync.layers


@pytest.mark.gpu
def test_a_raw_cu_stream_synchronize_is_a_range_with_cupti(backend, cuda_device, tmp_path):
    if backend != "cupti":
        pytest.skip("a raw driver call is seen by the CUPTI backend only")
    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    libcuda.cuStreamSynchronize.restype = ctypes.c_int
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with syncs.checking():
            queue_gpu_work(QUEUED_MS)
            line = here()
            assert libcuda.cuStreamSynchronize(stream) == 0
    events = save(prof, "raw-sync-cupti", tmp_path)
    (ours,) = ranges_at(events, line)
    assert ours["tid"] == threading.get_native_id() and ours["dur"] >= AT_LEAST_US, ours


@pytest.mark.gpu
def test_the_picture_for_the_docs(cuda_device, tmp_path):
    """A decode-like loop with planted syncs on two threads: saves timeline.png/.json for docs/syncs.md."""
    use = "cupti"
    try:
        require_cupti()
    except pytest.skip.Exception:
        use = "torch"
    x = torch.randn(1 << 20, device=cuda_device)
    pageable = torch.empty(1 << 20)
    with detector(use):
        def worker():
            for _ in range(3):
                with syncs.checking():
                    queue_gpu_work(4)
                    torch.cuda.synchronize()  # a host wait on a second thread

        thread = threading.Thread(target=worker, name="d2h-worker")
        thread.start()
        for step in range(8):
            with syncs.checking():
                y = x * 2 + 1
                queue_gpu_work(3)
                if step % 3 == 1:
                    y.sum().item()  # a planted .item()
                if step == 5:
                    pageable.copy_(y, non_blocking=True)  # a non_blocking copy into pageable memory
        thread.join()
        torch.cuda.synchronize()
        found = syncs.report()
        folder = artifacts(tmp_path)
        found.to_chrome_trace(folder / "timeline.json")
        found.plot(folder / "timeline.png")
        print(found.format(stacks=False))
        assert len(found.timeline.regions) == 12 and found.timeline.syncs  # and the warm-up region
        assert (folder / "timeline.png").stat().st_size > 0

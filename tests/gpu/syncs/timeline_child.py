"""The GPU bodies of ``test_timeline_gpu.py``, each run alone in a fresh interpreter.

    python timeline_child.py SCENARIO BACKEND FOLDER RESULT

CUPTI allows one subscriber per process, and torch.profiler (kineto) keeps
its subscription once a profiler session has started: a CUPTI-backend
check after a profiled test in the same process falls back to the torch
backend. So each scenario runs here, in a process of its own: it saves the
profiler's trace (``NAME-profiler.json``), the detector's trace
(``NAME-syncless.json``) and picture (``NAME-syncless.png``) in FOLDER, and
writes what the test asserts on to RESULT as JSON (the line it blocked at,
the thread's native id, the backend choice, the timeline's syncs). The
assertions are the test's; this file only checks its own preconditions.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import sys
import threading
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from syncless import syncs

#: GPU work queued before the blocking call: well above the test's 15 ms threshold, since launching the
#: call's own ops under the profiler and the detector eats part of the queue before the host blocks.
QUEUED_MS = 60.0

_cycles_per_ms: list[float] = []


def here() -> int:
    """The line number of the caller's next line."""
    return sys._getframe(1).f_lineno + 1


def _calibrate() -> float:
    """``torch.cuda._sleep`` cycles per millisecond, the faster of two timings after a warm-up launch.

    The warm-up keeps the kernel's lazy loading out of the timing; the faster
    clock of the two makes the queued work at least as long as asked.
    """
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        best = max(best, 20_000_000 / start.elapsed_time(end))
    return best


def queue_gpu_work(ms: float) -> None:
    """Queue about ``ms`` milliseconds of GPU work on the current stream; does not block (calibrates once, blocking)."""
    if not _cycles_per_ms:
        _cycles_per_ms.append(_calibrate())
    torch.cuda._sleep(int(_cycles_per_ms[0] * ms))


@contextlib.contextmanager
def detector(backend: str):
    """The detector in record mode with ``backend``, the timeline recorded; yields the result to fill.

    On a clean exit the result gets the backend choice (read before
    ``disable()``), the timeline's syncs and its number of regions.
    """
    syncs.set_mode("record")
    syncs.set_backend(backend)
    syncs.reset()
    syncs.record_timeline(True)
    queue_gpu_work(0)  # calibrates, before enable(): its event waits are not the scenario's
    torch.cuda.synchronize()
    if not syncs.enable():
        raise RuntimeError("the detector must be active on a GPU machine")
    result: dict = {"backend": backend, "tid": threading.get_native_id()}
    try:
        with syncs.checking():
            pass  # the first region takes CUPTI (cupti backend) before any profiler starts
        yield result
        result["choice"] = dataclasses.asdict(syncs.backend_choice())
        timeline = syncs.report().timeline
        result["syncs"] = [{"filename": os.path.basename(s.filename), "lineno": s.lineno, "function": s.function,
                            "tid": s.tid, "timed": s.timed, "blocked_ns": s.blocked_ns, "layers": list(s.layers)}
                           for s in timeline.syncs]
        result["regions"] = len(timeline.regions)
    finally:
        syncs.disable()
        syncs.record_timeline(False)
        syncs.reset()  # nothing left for record mode's report at exit


def save(prof, name: str, folder: Path) -> None:
    """Save the profiler's trace and the detector's trace and picture in ``folder``."""
    prof.export_chrome_trace(str(folder / f"{name}-profiler.json"))
    found = syncs.report()
    found.to_chrome_trace(folder / f"{name}-syncless.json")
    found.plot(folder / f"{name}-syncless.png")


def item_behind_queued_work(backend: str, folder: Path) -> dict:
    """An ``.item()`` behind ``QUEUED_MS`` of queued GPU work, in a checked region, under the profiler."""
    with detector(backend) as result:
        x = torch.randn(1 << 20, device="cuda")
        x.sum().item()  # warm up outside any region
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with syncs.checking():
                queue_gpu_work(QUEUED_MS)
                line = here()
                value = x.sum().item()
        result.update(line=line, value_type=type(value).__name__, name=f"item-{backend}")
        save(prof, result["name"], folder)
    return result


def raw_cu_stream_synchronize(backend: str, folder: Path) -> dict:
    """A raw ``cuStreamSynchronize`` through ctypes behind queued GPU work, in a checked region, profiled."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    libcuda.cuStreamSynchronize.restype = ctypes.c_int
    with detector(backend) as result:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with syncs.checking():
                queue_gpu_work(QUEUED_MS)
                line = here()
                status = libcuda.cuStreamSynchronize(stream)
        result.update(line=line, status=status, name=f"raw-sync-{backend}")
        save(prof, result["name"], folder)
    return result


def picture_for_the_docs(backend: str, folder: Path) -> dict:
    """A decode-like loop with planted syncs on two threads; saves ``timeline.png``/``.json`` for docs/syncs.md."""
    x = torch.randn(1 << 20, device="cuda")
    pageable = torch.empty(1 << 20)
    with detector(backend) as result:
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
        found.to_chrome_trace(folder / "timeline.json")
        found.plot(folder / "timeline.png")
        print(found.format(stacks=False))
        result["name"] = "timeline"
    return result


SCENARIOS = {"item": item_behind_queued_work, "raw-sync": raw_cu_stream_synchronize,
             "picture": picture_for_the_docs}


def main(argv: list[str]) -> None:
    scenario, backend, folder, result_path = argv
    result = SCENARIOS[scenario](backend, Path(folder))
    Path(result_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])

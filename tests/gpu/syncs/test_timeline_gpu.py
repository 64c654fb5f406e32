"""The syncs on a timeline on a real GPU, with both backends: torch.profiler ranges, the trace JSON, the picture.

An ``.item()`` behind ~60 ms of queued GPU work (``torch.cuda._sleep``,
calibrated first) must show in the profiler's trace at the user's line, on
the thread that blocked:

* CUPTI backend: as a range of at least 15 ms (opened around the blocking
  CUDA call itself); a raw ``cuStreamSynchronize`` through ctypes too;
* torch backend: as a marker right after torch's own ``aten::item`` range,
  which holds the blocked time (torch reports the sync after it returned;
  ``docs/syncs.md``, "On the timeline").

Each test runs its GPU part in a fresh interpreter (``timeline_child.py``,
which says why: kineto keeps CUPTI once a profiler session started) and
asserts here on what the child saved and reported.

With ``SYNCLESS_GPU_ARTIFACTS=DIR`` each test saves the profiler's trace, the
detector's trace and the picture there (the lead commits them under
``bench/results/``); ``test_the_picture_for_the_docs`` draws the one in
``docs/syncs.md``.

The profiler records CPU activities only: with the CUPTI backend the
detector holds CUPTI, and the profiler's CUDA activities would be lost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from syncless.syncs import _timeline

from .cupti_fixtures import require_cupti

CHILD = Path(__file__).with_name("timeline_child.py")
CHILD_TIMEOUT_S = 120
AT_LEAST_US = 15_000  # the child queues 60 ms (timeline_child.QUEUED_MS): the margin covers what launching eats


def artifacts(tmp_path: Path) -> Path:
    """Where to save what a test made: ``SYNCLESS_GPU_ARTIFACTS`` if set, else the test's tmp_path."""
    folder = os.environ.get("SYNCLESS_GPU_ARTIFACTS")
    path = Path(folder) if folder else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


def _tail(text: str | bytes | None, size: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-size:]


def run_child(scenario: str, backend: str, tmp_path: Path) -> tuple[dict, Path]:
    """Run ``scenario`` with ``backend`` in a fresh interpreter; return its result and the folder it saved in."""
    folder = artifacts(tmp_path)
    result_path = tmp_path / f"{scenario}-{backend}-result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the same syncless, torch and cupti as here
    command = [sys.executable, str(CHILD), scenario, backend, str(folder), str(result_path)]
    print(f"running {scenario} ({backend}) in a fresh process (timeout {CHILD_TIMEOUT_S} s)", flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{scenario} ({backend}) ran past {CHILD_TIMEOUT_S} s and was killed; its stderr ends:\n"
                    f"{_tail(err.stderr)}", pytrace=False)
    print(done.stdout)
    assert done.returncode == 0 and result_path.exists(), (
        f"{scenario} ({backend}) exited with {done.returncode}; its stderr ends:\n{_tail(done.stderr)}")
    return json.loads(result_path.read_text()), folder


def saved_events(folder: Path, name: str) -> list[dict]:
    """The complete events of the profiler's trace saved as ``NAME-profiler.json``; checks the picture is there."""
    assert (folder / f"{name}-syncless.png").stat().st_size > 0
    assert (folder / f"{name}-syncless.json").stat().st_size > 0
    with open(folder / f"{name}-profiler.json") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def ranges_at(events: list[dict], line: int) -> list[dict]:
    return [e for e in events if e["name"].startswith(f"{_timeline.SYNC_PREFIX} {CHILD.name}:{line} ")]


@pytest.fixture(params=["torch", "cupti"])
def backend(request, cuda_device):
    if request.param == "cupti":
        require_cupti()
    return request.param


@pytest.mark.gpu
def test_an_item_behind_queued_work_is_a_range_at_the_users_line(backend, tmp_path):
    result, folder = run_child("item", backend, tmp_path)
    assert result["choice"]["active"] == backend, result["choice"]
    assert result["value_type"] == "float", result
    events = saved_events(folder, result["name"])
    line, tid = result["line"], result["tid"]
    ours = ranges_at(events, line)
    assert ours, [e["name"] for e in events]
    assert all(e["tid"] == tid for e in ours)
    assert all("(item_behind_queued_work)" in e["name"] for e in ours)
    longest = max(e["dur"] for e in ours)
    print(f"{backend}: {len(ours)} range(s) at line {line}, longest {longest:.1f} us")
    if backend == "cupti":
        assert longest >= AT_LEAST_US, ours
    else:
        # The marker follows torch's own range of the op, which holds the blocked time.
        items = [e for e in events if e["name"] == "aten::item" and e["tid"] == tid]
        assert items and max(e["dur"] for e in items) >= AT_LEAST_US, items
        item = max(items, key=lambda e: e["dur"])
        assert ours[0]["ts"] >= item["ts"] + item["dur"] - 1, (ours[0], item)
    (sync,) = [s for s in result["syncs"] if s["lineno"] == line]
    if backend == "cupti":
        assert sync["timed"] and sync["blocked_ns"] >= AT_LEAST_US * 1000 and "cupti" in sync["layers"], sync


@pytest.mark.gpu
def test_a_raw_cu_stream_synchronize_is_a_range_with_cupti(backend, tmp_path):
    if backend != "cupti":
        pytest.skip("a raw driver call is seen by the CUPTI backend only")
    result, folder = run_child("raw-sync", backend, tmp_path)
    assert result["choice"]["active"] == backend, result["choice"]
    assert result["status"] == 0, result
    events = saved_events(folder, result["name"])
    (ours,) = ranges_at(events, result["line"])
    assert ours["tid"] == result["tid"] and ours["dur"] >= AT_LEAST_US, ours


@pytest.mark.gpu
def test_the_picture_for_the_docs(cuda_device, tmp_path):
    """A decode-like loop with planted syncs on two threads: saves timeline.png/.json for docs/syncs.md."""
    use = "cupti"
    try:
        require_cupti()
    except pytest.skip.Exception:
        use = "torch"
    result, folder = run_child("picture", use, tmp_path)
    assert result["choice"]["active"] == use, result["choice"]
    assert result["regions"] == 12 and result["syncs"], result  # and the warm-up region
    assert (folder / "timeline.png").stat().st_size > 0
    assert (folder / "timeline.json").stat().st_size > 0

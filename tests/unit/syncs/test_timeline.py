"""The syncs on a timeline, on the CPU: torch.profiler ranges, NVTX (stubbed), the trace JSON, the picture.

torch's debug-mode warning is played by the fake the other detector tests use; the CUPTI layer by the
stand-in ``fake_cupti``. The profiler is torch's own, recording CPU activities.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

from syncless import syncs
from syncless._core import config
from syncless._core.errors import ConfigError, MissingDependencyError
from syncless.syncs import _backend, _chrome_trace, _timeline
from syncless.syncs import _cupti_rules as rules

from . import fake_cupti as fake
from .conftest import torch_sync_warning
from .test_syncs_report import run_trace

HERE = "test_timeline.py"


def here() -> int:
    """The line number of the caller's next line."""
    return sys._getframe(1).f_lineno + 1


@pytest.fixture
def timeline_off():
    """Every sink off before and after the test."""
    saved = (_timeline.state.nvtx, _timeline.state.recording)
    syncs.set_nvtx(False)
    syncs.record_timeline(False)
    yield
    syncs.set_nvtx(saved[0])
    syncs.record_timeline(saved[1])


@pytest.fixture
def recording(fake_mode, timeline_off):
    syncs.record_timeline(True)
    yield fake_mode


@pytest.fixture
def cupti_recording(restored_globals, timeline_off, monkeypatch):
    """Record mode on the stand-in cupti (backend cupti) and a fake debug-mode switch, the timeline recorded."""
    from syncless.syncs import _debugmode

    fake.driver.reset()
    monkeypatch.setitem(sys.modules, "cupti", fake)
    layers = _backend.backend
    saved = (layers.requested, layers.api, layers.pointer_types)
    layers.requested, layers.api, layers.pointer_types = "auto", None, fake.pointer_types
    with _debugmode.fake():
        syncs.set_mode("record")
        syncs.reset()
        assert syncs.enable()
        syncs.record_timeline(True)
        yield
        syncs.disable()
        syncs.reset()
    layers.requested, layers.api, layers.pointer_types = saved
    layers.failure = None


def profiler_events(prof, tmp_path) -> list[dict]:
    path = tmp_path / "profiler.json"
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        trace = json.load(f)
    return trace, [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def named(events, prefix):
    return [e for e in events if e["name"].startswith(prefix)]


# -- the trace file ---------------------------------------------------------------------------------

def test_the_trace_json_loads_and_holds_each_sync_each_region_and_the_threads(recording, tmp_path):
    with syncs.checking():
        first = here()
        torch_sync_warning()
        second = here()
        torch_sync_warning()

    def worker():
        with syncs.checking():
            torch_sync_warning()

    thread = threading.Thread(target=worker, name="d2h-worker")
    thread.start()
    thread.join()
    path = tmp_path / "syncs.json"
    syncs.report().to_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    assert trace["displayTimeUnit"] == "ms" and isinstance(trace["baseTimeNanoseconds"], int)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    for event in complete:
        assert {"name", "ts", "dur", "pid", "tid", "cat"} <= set(event)
        assert isinstance(event["ts"], float | int) and event["dur"] >= 0
    syncs_ = named(complete, _timeline.SYNC_PREFIX)
    assert [e["name"] for e in syncs_][:2] == [f"syncless: hidden sync {HERE}:{first} "
                                                "(test_the_trace_json_loads_and_holds_each_sync_each_region_and_the_threads)",
                                                f"syncless: hidden sync {HERE}:{second} "
                                                "(test_the_trace_json_loads_and_holds_each_sync_each_region_and_the_threads)"]
    args = syncs_[0]["args"]
    assert args["site"].endswith(f"{HERE}:{first}") and args["kind"] == "explicit" and args["mode"] == "record"
    assert args["seen_by"] == "torch" and args["timed"] is False and args["blocked_us"] == 0
    assert HERE in args["stack"]
    assert syncs_[0]["tid"] == threading.get_native_id()
    regions = named(complete, _timeline.REGION_NAME)
    assert len(regions) == 2
    main_region = next(r for r in regions if r["tid"] == threading.get_native_id())
    assert main_region["ts"] <= syncs_[0]["ts"] <= syncs_[1]["ts"] <= main_region["ts"] + main_region["dur"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[threading.get_native_id()] == threading.current_thread().name
    assert names[syncs_[2]["tid"]] == "d2h-worker" and syncs_[2]["tid"] != syncs_[0]["tid"]


def test_without_record_timeline_a_trace_says_how_to_get_one(fake_mode, timeline_off, tmp_path):
    with syncs.checking():
        torch_sync_warning()
    found = syncs.report()
    assert found.total == 1 and found.timeline is None
    with pytest.raises(ValueError, match="record_timeline"):
        found.to_chrome_trace(tmp_path / "x.json")
    with pytest.raises(ValueError, match="record_timeline"):
        found.plot(tmp_path / "x.png")


def test_reset_forgets_the_timeline_and_record_timeline_checks_its_argument(recording):
    with syncs.checking():
        torch_sync_warning()
    assert len(syncs.report().timeline.syncs) == 1
    syncs.reset()
    timeline = syncs.report().timeline
    assert timeline.syncs == [] and timeline.regions == []
    with pytest.raises(TypeError, match="bool"):
        syncs.record_timeline(1)
    with pytest.raises(TypeError, match="bool"):
        syncs.set_nvtx("yes")


def test_the_base_is_kinetos_so_both_files_count_from_the_same_point(recording, tmp_path):
    """A sync inside a profiler's record_function: its ts here lies inside that range's in the profiler's trace."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with syncs.checking():
            with record_function("outer"):
                time.sleep(0.002)
                torch_sync_warning()
                time.sleep(0.002)
    trace, events = profiler_events(prof, tmp_path)
    (outer,) = named(events, "outer")
    ours = _chrome_trace.trace_events(syncs.report().timeline)
    assert ours["baseTimeNanoseconds"] == trace["baseTimeNanoseconds"]
    (sync,) = named([e for e in ours["traceEvents"] if e["ph"] == "X"], _timeline.SYNC_PREFIX)
    assert outer["ts"] <= sync["ts"] <= outer["ts"] + outer["dur"]
    assert sync["tid"] == outer["tid"] and sync["pid"] == outer["pid"]


# -- torch.profiler -----------------------------------------------------------------------------------

def test_a_sync_is_a_range_in_the_profilers_trace_on_its_thread(fake_mode, timeline_off, tmp_path):
    # torch.profiler records the threads other than its own only with profile_all_threads (its own rule).
    with profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        with syncs.checking():
            for _ in range(3):
                line = here()
                torch_sync_warning()

        def worker():
            with syncs.checking():
                torch_sync_warning()

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    _, events = profiler_events(prof, tmp_path)
    name = f"syncless: hidden sync {HERE}:{line} (test_a_sync_is_a_range_in_the_profilers_trace_on_its_thread)"
    ranges = [e for e in events if e["name"] == name]
    assert len(ranges) == 3
    assert {e["tid"] for e in ranges} == {threading.get_native_id()}
    others = [e for e in named(events, _timeline.SYNC_PREFIX) if e["name"] != name]
    assert len(others) == 1 and others[0]["tid"] != threading.get_native_id() and "(worker)" in others[0]["name"]
    counts = {row.key: row.count for row in prof.key_averages()}
    assert counts[name] == 3


def test_no_range_without_a_profiler_and_no_work_while_everything_is_off(fake_mode, timeline_off, monkeypatch):
    def refuse(*args):
        raise AssertionError(f"the timeline did work with every sink off: {args}")

    monkeypatch.setattr(_timeline, "_Span", refuse)
    monkeypatch.setattr(_timeline, "_keep", refuse)
    monkeypatch.setattr(syncs._state, "on_region_closed", refuse)
    with syncs.checking():
        torch_sync_warning()
    assert syncs.report().total == 1 and syncs.report().timeline is None


def test_a_cupti_call_gets_a_range_around_the_call_itself(cupti_recording, tmp_path):
    """The range is opened before the blocking call and closed after it: what runs inside the call nests in it."""
    seen_ns = []

    def blocking_body():
        with record_function("inside the call"):
            seen_ns.append(time.time_ns())
            time.sleep(0.002)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with syncs.checking():
            line = here()
            fake.call("cuStreamSynchronize", [0], body=blocking_body)
    _, events = profiler_events(prof, tmp_path)
    (ours,) = named(events, f"syncless: hidden sync {HERE}:{line} ")
    (inside,) = named(events, "inside the call")
    assert ours["ts"] <= inside["ts"] and inside["ts"] + inside["dur"] <= ours["ts"] + ours["dur"]
    (sync,) = syncs.report().timeline.syncs
    assert sync.timed and sync.layers == ("cupti",) and sync.lineno == line
    assert sync.start_ns <= seen_ns[0] <= sync.start_ns + sync.blocked_ns


def test_an_item_like_op_is_one_sync_on_the_timeline_from_its_first_cuda_call(cupti_recording, tmp_path):
    D2H = rules.KIND_D2H
    started = time.time_ns()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with syncs.checking():
            line = here()
            fake.torch_op([("cudaMemcpyAsync", [fake.PAGEABLE_ADDR, fake.DEVICE_ADDR, 4, D2H, 0]),
                           ("cudaStreamSynchronize", [0])])
    (sync,) = syncs.report().timeline.syncs
    assert sync.layers == ("torch", "cupti") and sync.kind == "explicit" and sync.lineno == line
    assert sync.apis == {"cudaMemcpyAsync": 1, "cudaStreamSynchronize": 1}
    assert started <= sync.start_ns
    _, events = profiler_events(prof, tmp_path)
    ranges = named(events, f"syncless: hidden sync {HERE}:{line} ")
    assert len(ranges) == 2  # one around each blocking CUDA call; torch's warning after them adds no marker


def test_an_allowed_sync_makes_no_range(cupti_recording, tmp_path):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with syncs.checking():
            with syncs.allowed():
                fake.call("cuStreamSynchronize", [0])
                torch_sync_warning()
    _, events = profiler_events(prof, tmp_path)
    assert not named(events, _timeline.SYNC_PREFIX)
    assert syncs.report().timeline.syncs == []


# -- NVTX ---------------------------------------------------------------------------------------------

@pytest.fixture
def nvtx_calls(monkeypatch, timeline_off):
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: calls.append(("push", msg)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    syncs.set_nvtx(True)
    return calls


def test_with_nvtx_on_each_sync_is_an_nvtx_range(fake_mode, nvtx_calls):
    with syncs.checking():
        line = here()
        torch_sync_warning()
    name = f"syncless: hidden sync {HERE}:{line} (test_with_nvtx_on_each_sync_is_an_nvtx_range)"
    assert nvtx_calls == [("push", name), ("pop",)]
    syncs.set_nvtx(False)
    with syncs.checking():
        torch_sync_warning()
    assert len(nvtx_calls) == 2


def test_with_nvtx_on_a_cupti_call_is_pushed_before_it_and_popped_after(cupti_recording, nvtx_calls):
    with syncs.checking():
        fake.call("cuStreamSynchronize", [0], body=lambda: nvtx_calls.append(("inside",)))
    assert [c[0] for c in nvtx_calls] == ["push", "inside", "pop"]


def test_the_nvtx_variable_is_in_the_registry(monkeypatch):
    monkeypatch.setenv("SYNCLESS_SYNC_NVTX", "1")
    assert config.read("SYNCLESS_SYNC_NVTX") is True
    monkeypatch.setenv("SYNCLESS_SYNC_NVTX", "loud")
    with pytest.raises(ConfigError, match="SYNCLESS_SYNC_NVTX"):
        config.read("SYNCLESS_SYNC_NVTX")
    monkeypatch.delenv("SYNCLESS_SYNC_NVTX")
    assert config.read("SYNCLESS_SYNC_NVTX") is False


# -- the picture and syncless trace ---------------------------------------------------------------------

def test_the_picture_is_written(recording, tmp_path):
    with syncs.checking():
        torch_sync_warning()
        time.sleep(0.001)
        torch_sync_warning()
    path = tmp_path / "syncs.png"
    syncs.report().plot(path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_without_matplotlib_the_picture_says_what_to_install(recording, tmp_path, monkeypatch):
    with syncs.checking():
        torch_sync_warning()
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(MissingDependencyError, match="matplotlib"):
        syncs.report().plot(tmp_path / "x.png")


SCRIPT = (
    "import functools, warnings\n"
    "sync = functools.partial(warnings.warn, 'called a synchronizing CUDA operation', UserWarning)\n"
    "def step(i):\n"
    "    sync()\n"
    "for i in range(3):\n"
    "    step(i)\n"
)


@pytest.mark.parametrize("suffix", [".json", ".png"])
def test_trace_writes_the_timeline(tmp_path, capsys, restored_globals, timeline_off, suffix):
    from syncless.syncs import _debugmode

    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"out{suffix}"
    with _debugmode.fake():
        assert run_trace(["--fn", "__main__:step", "--timeline", str(out), str(script)]) == 0
    assert f"timeline written to {out}" in capsys.readouterr().out
    if suffix == ".json":
        with open(out) as f:
            events = json.load(f)["traceEvents"]
        assert len(named([e for e in events if e["ph"] == "X"], "syncless: hidden sync loop.py:4 (step)")) == 3
        assert len(named([e for e in events if e["ph"] == "X"], _timeline.REGION_NAME)) == 3
    else:
        assert out.read_bytes().startswith(b"\x89PNG")
    assert not _timeline.is_recording()


def test_trace_refuses_a_timeline_it_cannot_write(tmp_path, capsys, restored_globals, timeline_off):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    assert run_trace(["--timeline", str(tmp_path / "out.txt"), str(script)]) == 2
    assert "--timeline writes .json" in capsys.readouterr().err


def test_the_profilers_ts_counts_realtime_microseconds_from_its_base(tmp_path):
    """The clock docs/syncs.md names: ts * 1000 + baseTimeNanoseconds lies between time.time_ns() before and after."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        before = time.time_ns()
        with record_function("probe"):
            time.sleep(0.001)
        after = time.time_ns()
    trace, events = profiler_events(prof, tmp_path)
    (probe,) = named(events, "probe")
    start_ns = round(probe["ts"] * 1000) + trace["baseTimeNanoseconds"]
    assert before <= start_ns <= start_ns + round(probe["dur"] * 1000) <= after
    assert trace["baseTimeNanoseconds"] == _chrome_trace.base_ns(before)

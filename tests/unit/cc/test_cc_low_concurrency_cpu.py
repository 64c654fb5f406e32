"""Issue 33, the host's cost at batch 1, on a CPU-only torch: the readback lane's look for a draining D2H stream,
the offloaded job's waits, and the patched ordering calls that go straight to torch with nothing to cover."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from syncless._core import libcuda, patching
from syncless.cc import _d2h, _emulation, _fast, _raw, _sync_patches, _worker
from syncless.cc._layers import SHIM_KEY
from support.lane_block import LaneBlock

# -- the readback lane's look ------------------------------------------------------------------------------


class _Clock:
    """A clock that moves ``step_s`` at every read (each query of the look reads it once)."""

    def __init__(self, step_s: float) -> None:
        self.now = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def _lane_and_record(drained_after: int | None):
    """A lane whose stream query says True from its ``drained_after``-th call on (None: never), and a D2H record."""
    calls = []

    def query(stream):
        calls.append(stream)
        return drained_after is not None and len(calls) > drained_after

    stream = object()
    record = _d2h._D2HStream(stream)
    return SimpleNamespace(stream_query=query), record, calls


def test_a_stream_that_drains_at_the_looks_first_query_is_read_back_now(monkeypatch):
    monkeypatch.setattr(_fast, "_clock", _Clock(1e-6))
    lane, record, calls = _lane_and_record(drained_after=0)
    assert _fast._drains_soon(lane, record)
    assert calls == [record.stream]


def test_a_stream_that_drains_while_looked_at_is_read_back_now_and_clears_the_misses(monkeypatch):
    monkeypatch.setattr(_fast, "_clock", _Clock(1e-6))
    lane, record, calls = _lane_and_record(drained_after=5)
    record.drain_misses = 3
    assert _fast._drains_soon(lane, record)
    assert len(calls) == 6 and record.drain_misses == 0 and record.drain_skips == 0


def test_a_look_that_times_out_offloads_and_the_next_looks_are_skipped_twice_as_long_each_miss(monkeypatch):
    clock = _Clock(1e-6)
    monkeypatch.setattr(_fast, "_clock", clock)
    lane, record, calls = _lane_and_record(drained_after=None)
    started = clock.now
    assert not _fast._drains_soon(lane, record)
    # the look lasted DRAIN_LOOK_S (one clock step per query), never longer
    assert _fast.DRAIN_LOOK_S <= clock.now - started <= _fast.DRAIN_LOOK_S + 3e-6
    assert record.drain_skips == 2
    skipped = []
    for expected_skips in (4, 8, 16, 32, 64, 64, 64):
        while record.drain_skips:
            before = len(calls)
            assert not _fast._drains_soon(lane, record)
            skipped.append(len(calls) - before)
        assert not _fast._drains_soon(lane, record)  # the next one looks again, and misses again
        assert record.drain_skips == expected_skips
    assert set(skipped) == {0}  # a skipped readback makes no look (the lane's own query came before it)
    assert record.drain_skips <= _fast.MAX_DRAIN_SKIPS


def _readback_lane(monkeypatch, drained: bool):
    """``_fast._offload``'s world: one D2H stream current on GPU 0 whose query answers ``drained``; what the lane
    then did is logged (``read_now``: torch's own copy at the call; ``offloaded``)."""
    from syncless.cc import _helper

    log, queries = [], []
    record = _d2h._D2HStream(object())

    def query(stream):
        queries.append(stream)
        return drained

    lane = SimpleNamespace(current_device=lambda: 0, capturing=lambda: False, raw_stream=lambda index: 7,
                           strided="strided", grad_enabled=lambda: True, stream_query=query)
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 7): record})
    monkeypatch.setattr(_helper, "ENABLED", [False])
    monkeypatch.setattr(_fast, "_read_back_now", lambda lane, src, device, rec: log.append("read_now") or "now")
    monkeypatch.setattr(_d2h, "pinned_block", lambda src, dtype: "pinned")
    monkeypatch.setattr(_d2h, "offload_block", lambda rec, dst, src, index: log.append("offloaded") or 1)
    monkeypatch.setattr(_fast, "_clock", _Clock(1e-6))
    return lane, record, log, queries


def test_a_skipped_look_still_reads_back_now_from_a_stream_that_has_drained(monkeypatch):
    lane, record, log, queries = _readback_lane(monkeypatch, drained=True)
    record.drain_skips = 10
    assert _fast._offload(lane, LaneBlock(), "cpu", 1 << 20) == "now"
    assert log == ["read_now"] and queries == [record.stream] and record.drain_skips == 10


def test_a_busy_stream_with_looks_to_skip_is_offloaded_after_one_query(monkeypatch):
    lane, record, log, queries = _readback_lane(monkeypatch, drained=False)
    record.drain_skips = 3
    assert _fast._offload(lane, LaneBlock(), "cpu", 1 << 20) == "pinned"
    assert log == ["offloaded"] and queries == [record.stream] and record.drain_skips == 2


def test_a_readback_behind_an_unfinished_offload_of_its_stream_is_offloaded_without_a_query(monkeypatch):
    lane, record, log, queries = _readback_lane(monkeypatch, drained=True)
    monkeypatch.setattr(_d2h, "_PENDING", [1])
    record.last_job = 5  # its worker has finished none of them (completed 0)
    assert _fast._offload(lane, LaneBlock(), "cpu", 1 << 20) == "pinned"
    assert log == ["offloaded"] and queries == []


def test_a_readback_while_only_other_streams_have_copies_pending_is_still_read_back_now(monkeypatch):
    lane, record, log, queries = _readback_lane(monkeypatch, drained=True)
    monkeypatch.setattr(_d2h, "_PENDING", [2])  # another D2H stream's copies; this one's last job has finished
    assert _fast._offload(lane, LaneBlock(), "cpu", 1 << 20) == "now"
    assert log == ["read_now"]


# -- the offloaded job: its waits and its hand-offs of the GIL ------------------------------------------


class _Library:
    """A stand-in for one handle on libcuda: logs ``(handle, name)`` of each call, answers 0 (or ``answers``)."""

    def __init__(self, handle: str, log: list, answers: dict | None = None) -> None:
        self._handle, self._log, self._answers = handle, log, answers or {}

    def __getattr__(self, name: str):
        def call(*args):
            self._log.append((self._handle, name))
            return self._answers.get(name, 0)

        return call


def _run_job(monkeypatch, *, emulating: bool, enqueues_only: bool, finishes_at_call: bool, quick_answers=None):
    log: list = []
    quick, blocking = _Library("quick", log, quick_answers), _Library("blocking", log)
    monkeypatch.setattr(libcuda, "libraries", lambda: (quick, blocking))
    monkeypatch.setattr(_raw, "enter_context", lambda index: False)
    monkeypatch.setattr(_emulation, "is_emulating", lambda: emulating)
    monkeypatch.setattr(_raw, "COPIES_FINISH_AT_CALL", [finishes_at_call])
    monkeypatch.setattr(_raw, "COPY_ONLY_ENQUEUES", [enqueues_only])
    _raw.run_copy_job(0, 11, 22, 33, 64, SimpleNamespace(cuda_stream=44))
    return log


NOT_READY = libcuda.CUDA_ERROR_NOT_READY


@pytest.mark.parametrize("case, emulating, enqueues_only, finishes_at_call, answers, calls", [
    # CC emulated on a CC-off GPU, the event fired (read a step late): the copy only enqueues (GIL held), and the
    # one wait is the synchronize CC would make: one hand-off of the GIL
    ("emulated", True, True, False, {},
     [("quick", "cuEventQuery"), ("quick", "cuMemcpyDtoHAsync_v2"), ("blocking", "cuStreamSynchronize")]),
    # the event has not fired: the host waits for it (never a GPU-side wait on the copy stream, which would hold
    # whatever shares its hardware queue behind the producer)
    ("not fired", True, True, False, {"cuEventQuery": NOT_READY},
     [("quick", "cuEventQuery"), ("blocking", "cuEventSynchronize"), ("quick", "cuMemcpyDtoHAsync_v2"),
      ("blocking", "cuStreamSynchronize")]),
    # emulated on a machine NVML says has CC on: the driver's copy blocks there, so it lets go of the GIL
    ("emulated on CC", True, False, False, {},
     [("quick", "cuEventQuery"), ("blocking", "cuMemcpyDtoHAsync_v2"), ("blocking", "cuStreamSynchronize")]),
    # CC confirmed by NVML: the copy is the wait, and a query (GIL held) confirms it
    ("CC", False, False, True, {},
     [("quick", "cuEventQuery"), ("blocking", "cuMemcpyDtoHAsync_v2"), ("quick", "cuStreamQuery")]),
    ("CC, stream still busy", False, False, True, {"cuStreamQuery": NOT_READY},
     [("quick", "cuEventQuery"), ("blocking", "cuMemcpyDtoHAsync_v2"), ("quick", "cuStreamQuery"),
      ("blocking", "cuStreamSynchronize")]),
])
def test_the_jobs_driver_calls_and_which_let_go_of_the_gil(monkeypatch, case, emulating, enqueues_only,
                                                           finishes_at_call, answers, calls):
    assert _run_job(monkeypatch, emulating=emulating, enqueues_only=enqueues_only,
                    finishes_at_call=finishes_at_call, quick_answers=answers) == calls


def test_a_failed_query_is_raised_by_its_name(monkeypatch):
    from syncless._core.errors import CudaError

    monkeypatch.setattr(libcuda, "raise_for", lambda call, code: (_ for _ in ()).throw(CudaError(call, code, "E", "")))
    with pytest.raises(CudaError) as raised:
        _run_job(monkeypatch, emulating=False, enqueues_only=False, finishes_at_call=True,
                 quick_answers={"cuStreamQuery": 700})
    assert raised.value.call == "cuStreamQuery"


def test_the_enqueue_only_copy_is_set_at_install_only_for_emulation_where_nvml_says_cc_is_off(monkeypatch):
    import syncless.cc as cc
    from syncless.cc import _detect

    seen = {}
    monkeypatch.setattr(cc, "_cuda_available", lambda: True)
    monkeypatch.setattr(cc, "check_bindings", lambda: None)
    monkeypatch.setattr(cc, "_emulation_install", lambda: None)
    monkeypatch.setattr(cc, "install_shim", lambda max_staged_bytes: None)
    monkeypatch.setattr(_detect, "ask_nvml_for_cc", lambda: False)
    monkeypatch.setattr(cc, "uninstall_all", lambda timeout_s: None)
    try:
        for mode, nvml_says_cc in (("emulate", False), ("emulate", True), ("on", False)):
            monkeypatch.setattr(cc, "is_confidential_compute", lambda answer=nvml_says_cc: answer)
            cc.install(mode)
            seen[(mode, nvml_says_cc)] = _raw.COPY_ONLY_ENQUEUES[0]
        cc.uninstall()
        assert not _raw.COPY_ONLY_ENQUEUES[0]
    finally:
        _raw.COPY_ONLY_ENQUEUES[0] = False
        _raw.COPIES_FINISH_AT_CALL[0] = False
    assert seen == {("emulate", False): True, ("emulate", True): False, ("on", False): False}


def test_a_job_run_again_after_it_copied_makes_nothing_twice(monkeypatch):
    """An interrupt that lands after the copy (in or after its release) has the queue run the job again: it does
    nothing, and its ready event went back to the pool once (two offloads sharing one would wait on each other)."""
    from syncless.cc import _d2h_job

    copies, given_back = [], []
    monkeypatch.setattr(_raw, "run_copy_job", lambda *args: copies.append(args))
    monkeypatch.setattr(_raw, "give_back_ready_event", lambda index, event: given_back.append(event))
    tensor = SimpleNamespace(data_ptr=lambda: 1, nbytes=8, shape=(1,), dtype="int64", device="cuda:0")
    job = _d2h_job.CopyJob(0, 5, tensor, tensor, object(), "copy", tensor)
    job()
    job()
    assert len(copies) == 1 and given_back == [5]


# -- ordering calls with nothing to cover ---------------------------------------------------------------


def test_the_ordering_patches_go_straight_to_torch_while_nothing_is_pending(monkeypatch):
    """With no copy unfinished and no failure kept, the patched entry calls torch without the shim's layer."""

    class Owner:
        def record(self, value):
            return ("torch", value)

    layer_calls = []

    def wrap(next_record):
        def record(*args, **kwargs):
            layer_calls.append(args[1])
            return next_record(*args, **kwargs)

        return record

    patching.add_layer(Owner, "record", "test-idle", patching.RANK_CC_SHIM, wrap, idle=_d2h.busy)
    try:
        monkeypatch.setattr(_d2h, "_PENDING", [0])
        monkeypatch.setattr(_d2h, "UNRAISED", [0])
        assert Owner().record(1) == ("torch", 1) and layer_calls == []
        monkeypatch.setattr(_d2h, "_PENDING", [1])
        assert Owner().record(2) == ("torch", 2) and layer_calls == [2]
        monkeypatch.setattr(_d2h, "_PENDING", [0])
        monkeypatch.setattr(_d2h, "UNRAISED", [1])  # a failure kept: a synchronize must still raise it
        assert Owner().record(3) == ("torch", 3) and layer_calls == [2, 3]
    finally:
        patching.remove_layer(Owner, "record", "test-idle")


def test_which_ordering_patches_skip_their_layer_when_idle():
    """Every cover-only patch is idle-able; the capture hooks (they note every capture) and classes are not."""
    _sync_patches.install_sync_patches()
    try:
        idle_names, busy_names = set(), set()
        for owner, name, _ in _sync_patches.patch_targets():
            chain = patching._chains.get((id(owner), name))
            assert chain is not None, (owner, name)
            (idle_names if chain.idle.get(SHIM_KEY) is _d2h.busy else busy_names).add(name)
    finally:
        _sync_patches.uninstall_sync_patches()
    assert {"record", "wait", "synchronize", "query", "__setitem__", "new_tensor", "as_tensor", "copy_"} <= idle_names
    assert {"capture_begin", "capture_end", "Event"} & idle_names == set()


@pytest.mark.parametrize("pending", [0, 1])
def test_a_blocking_copy_reads_no_call_while_nothing_is_pending(monkeypatch, pending):
    """``dst.copy_(src)`` (a decode step's device copy) goes beneath at once unless an offloaded copy is pending."""
    import torch

    from syncless.cc import _shim

    reads = []
    real_read = _shim.read_copy
    monkeypatch.setattr(_shim, "read_copy", lambda *a, **k: reads.append(a) or real_read(*a, **k))
    monkeypatch.setattr(_d2h, "_PENDING", [pending])
    copied = []
    copy_ = _shim._wrap_copy(lambda *args, **kwargs: copied.append(args) or args[0])
    dst, src = torch.zeros(3), torch.ones(3)
    assert copy_(dst, src) is dst
    assert len(copied) == 1 and len(reads) == pending


def test_the_emulators_blocking_copy_reads_no_call_and_waits_for_nothing(monkeypatch):
    import torch

    reads, waits = [], []
    real_read = _emulation.read_copy
    monkeypatch.setattr(_emulation, "read_copy", lambda *a, **k: reads.append(a) or real_read(*a, **k))
    monkeypatch.setattr(_emulation, "_emulate_wait", lambda device: waits.append(device))
    copy_ = _emulation._wrap_copy(lambda *args, **kwargs: args[0])
    dst, src = torch.zeros(2), torch.ones(2)
    assert copy_(dst, src) is dst and reads == [] and waits == []
    assert copy_(dst, src, non_blocking=False) is dst and len(reads) == 1  # any other form is read, as before


def test_a_capture_begun_during_the_look_ends_it_before_the_next_query(monkeypatch):
    from syncless.cc import _streams

    monkeypatch.setattr(_fast, "_clock", _Clock(1e-6))
    monkeypatch.setattr(_streams, "CAPTURES", [0])
    lane, record, calls = _lane_and_record(drained_after=None)

    def query(stream):
        calls.append(stream)
        if len(calls) == 3:
            _streams.CAPTURES[0] = 1  # another thread's capture_begin noted it
        return False

    lane.stream_query = query
    assert not _fast._drains_soon(lane, record)
    assert len(calls) == 3


# -- Python calls on the hot paths (the GPU probe, tests/gpu/cc/probe_call_counts.py, counts the whole call) ----


def _syncless_calls(fn) -> list[str]:
    """The syncless functions ``fn()`` enters, in order (``module:function``), counted with sys.setprofile."""
    import sys

    names = []

    def profile(frame, event, arg):
        filename = frame.f_code.co_filename
        if event == "call" and "/syncless/" in filename and "/tests/" not in filename:
            names.append(f"{filename.rsplit('/', 1)[-1][:-3]}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


class _Stream:
    device_index = 0
    cuda_stream = 0x51


def _emulated_driver(monkeypatch, codes=None):
    """The emulator's wait with a stand-in ``cuStreamSynchronize`` (logs the stream and whether the thread stands
    for the driver during it) and GPU 0 current."""
    from syncless._core import driver_waits
    from syncless.cc import _streams

    waits = []

    def sync(handle):
        waits.append((handle, getattr(driver_waits.MARKS, "depth", 0) > 0))  # read, not called: not counted
        return (codes or {}).get(handle, 0)

    monkeypatch.setattr(_streams, "_STREAM_SYNC", [sync])
    monkeypatch.setitem(_streams._C_CALLS, "_cuda_getDevice", lambda: 0)
    return waits


def test_the_emulators_wait_is_one_python_call_and_stands_for_the_driver(monkeypatch):
    from syncless._core import driver_waits
    from syncless.cc import _streams

    waits = _emulated_driver(monkeypatch)
    assert _syncless_calls(lambda: _streams.wait_stream_raw(_Stream())) == ["_streams:wait_stream_raw"]
    assert waits == [(0x51, True)] and not driver_waits.is_standing_for_the_driver()


def test_the_emulators_wait_raises_the_drivers_error_and_leaves_the_mark_as_it_was(monkeypatch):
    from syncless._core import driver_waits
    from syncless._core.errors import CudaError
    from syncless.cc import _streams

    _emulated_driver(monkeypatch, codes={0x51: 700})
    monkeypatch.setattr(libcuda, "libraries", lambda: (_Library("quick", []), _Library("blocking", [])))
    with pytest.raises(CudaError, match="cuStreamSynchronize"):
        _streams.wait_stream_raw(_Stream())
    assert not driver_waits.is_standing_for_the_driver()


def test_the_emulators_wait_on_a_gpu_that_is_not_current_makes_it_current_first(monkeypatch):
    from syncless.cc import _streams

    waits = _emulated_driver(monkeypatch)
    monkeypatch.setitem(_streams._C_CALLS, "_cuda_getDevice", lambda: 1)  # GPU 1 current, the stream on GPU 0
    switched = []
    monkeypatch.setattr(_streams, "_wait_stream_on_its_device", lambda stream: switched.append(stream))
    stream = _Stream()
    _streams.wait_stream_raw(stream)
    assert switched == [stream] and waits == []


def test_the_readback_read_at_the_call_enters_seven_syncless_functions(monkeypatch):
    """docs/cc.md gives the count: the lane's offload check, the way (between trials), the read, the context check
    (two), the copy and its wait, the counters (one call since session 26; the patch entry, the shim's wrapper and
    the lane's dispatch come before: 10 in all)."""
    real_enter_context = _raw.enter_context
    lane, record, driver = _waiting_lane(monkeypatch, drained=True)
    monkeypatch.setattr(_raw, "enter_context", real_enter_context)
    monkeypatch.setitem(_raw._primary_handles, 0, 0)  # the stand-in driver's current context (cuCtxGetCurrent: 0)
    record.choice.phase, record.choice.left = 0, 100  # between two trials (._readback_choice._RUN)
    names = _syncless_calls(lambda: _fast._offload(lane, _SizedBlock(), "cpu", 1 << 20))
    assert names == ["_fast:_offload", "_readback_choice:offload", "_fast:_read_back_into", "_raw:enter_context", "libcuda:current_context",
                     "_raw:copy_to_host_now", "_stats:read_back_at_call"], names
    assert [call[:2] for call in driver.log] == [("quick", "cuCtxGetCurrent"), ("quick", "cuMemcpyDtoHAsync_v2"),
                                                 ("blocking", "cuStreamSynchronize")]


class _SizedBlock(LaneBlock):
    """:class:`LaneBlock` with the address the read at the call uses."""

    def data_ptr(self):
        return 0xD000


class _Driver:
    """Both libcuda handles: logs ``(handle, name, args, standing for the driver)``; ``codes``: name -> CUresult."""

    def __init__(self, events: list, codes: dict | None = None) -> None:
        self.log, self.events, self.codes = [], events, codes or {}

    def handle(self, which: str):
        from syncless._core import driver_waits

        driver = self

        class Handle:
            def __getattr__(self, name):
                def call(*args):
                    marked = getattr(driver_waits.MARKS, "depth", 0) > 0
                    driver.log.append((which, name, args, marked))
                    driver.events.append(name)
                    return driver.codes.get(name, 0)

                return call

        return Handle()


def _waiting_lane(monkeypatch, drained, *, emulating: bool = True, finishes_at_call: bool = False,
                  codes: dict | None = None, pushed: bool = False, enqueues_only: bool | None = None):
    """``_fast._offload``'s world where the host waits for a readback (CC emulated, or CC): one D2H stream (handle
    0x51) on GPU 0 whose query answers ``drained`` (a bool, or a list of answers in turn), a stand-in driver, and
    a log of the order of events (the result's allocation, the context check, queries, driver calls)."""
    from syncless.cc import _helper

    events: list = []
    answers = list(drained) if isinstance(drained, list) else None
    record = _d2h._D2HStream(SimpleNamespace(cuda_stream=0x51))

    def query(stream):
        events.append("query")
        return answers.pop(0) if answers is not None else drained

    def empty_strided(shape, stride, dtype, pin_memory):
        events.append("allocate")
        assert pin_memory is True and shape == (8,) and stride == (1,) and dtype == "int64"  # the source's
        return SimpleNamespace(data_ptr=lambda: 0xAB00, pinned=True)

    def enter_context(index):
        events.append("context")
        return pushed

    lane = SimpleNamespace(current_device=lambda: 0, capturing=lambda: False, raw_stream=lambda index: 7,
                           strided="strided", grad_enabled=lambda: True, stream_query=query,
                           empty_strided=empty_strided)
    driver = _Driver(events, codes)
    libs = [(driver.handle("quick"), driver.handle("blocking"))]
    monkeypatch.setattr(libcuda, "LOADED", libs)
    monkeypatch.setattr(libcuda, "_LIBS", libs)
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 7): record})
    monkeypatch.setattr(_helper, "ENABLED", [False])
    monkeypatch.setattr(_emulation, "_installed", emulating)
    monkeypatch.setattr(_raw, "COPIES_FINISH_AT_CALL", [finishes_at_call])
    monkeypatch.setattr(_raw, "COPY_ONLY_ENQUEUES", [emulating if enqueues_only is None else enqueues_only])
    monkeypatch.setattr(_raw, "PARKED", [])
    monkeypatch.setattr(_raw, "enter_context", enter_context)
    monkeypatch.setattr(_raw, "leave_context", lambda: events.append("leave"))
    monkeypatch.setattr(_fast, "_read_back_now", lambda lane, src, device, rec: events.append("torch's") or "torch's")
    monkeypatch.setattr(_d2h, "offload_block", lambda rec, dst, src, index: events.append(("offloaded", dst)) or 1)
    monkeypatch.setattr(_fast, "_clock", _Clock(1e-6))
    return lane, record, driver


def test_where_the_host_waits_the_result_and_the_context_come_before_the_look_and_only_the_copy_after(monkeypatch):
    lane, record, driver = _waiting_lane(monkeypatch, drained=[False, False, True])
    out = _fast._offload(lane, _SizedBlock(), "cpu", 1 << 20)
    assert out.pinned and out.data_ptr() == 0xAB00
    assert driver.events == ["allocate", "context", "query", "query", "query", "cuMemcpyDtoHAsync_v2",
                             "cuStreamSynchronize"]
    # the copy (GIL held: it only enqueues under emulation) into the result, from the source, on the D2H stream,
    # then the emulator's wait on that stream; both stand for the driver's own wait (the syncs detector skips them)
    assert driver.log == [("quick", "cuMemcpyDtoHAsync_v2", (0xAB00, 0xD000, 64, 0x51), True),
                          ("blocking", "cuStreamSynchronize", (0x51,), True)]


def test_under_cc_the_copy_lets_go_of_the_gil_and_is_done_when_it_returns(monkeypatch):
    lane, record, driver = _waiting_lane(monkeypatch, drained=True, emulating=False, finishes_at_call=True)
    assert _fast._offload(lane, _SizedBlock(), "cpu", 1 << 20).pinned
    # one call: under CC the copy returns once done (as torch's own copy at the call is trusted to), no query
    assert [call[:2] for call in driver.log] == [("blocking", "cuMemcpyDtoHAsync_v2")]


def test_emulated_on_a_gpu_with_cc_on_the_copy_may_block_so_it_lets_go_of_the_gil_then_the_wait(monkeypatch):
    lane, record, driver = _waiting_lane(monkeypatch, drained=True, emulating=True, enqueues_only=False)
    assert _fast._offload(lane, _SizedBlock(), "cpu", 1 << 20).pinned
    assert [call[:2] for call in driver.log] == [("blocking", "cuMemcpyDtoHAsync_v2"),
                                                 ("blocking", "cuStreamSynchronize")]


def test_where_the_host_waits_a_stream_that_does_not_drain_is_offloaded_into_the_result_made_for_it(monkeypatch):
    lane, record, driver = _waiting_lane(monkeypatch, drained=False, pushed=True)
    out = _fast._offload(lane, _SizedBlock(), "cpu", 1 << 20)
    assert driver.log == []  # no copy made at the call
    assert driver.events[:3] == ["allocate", "context", "query"]
    assert driver.events[-2:] == ["leave", ("offloaded", out)]  # the pushed context put back before the offload


def test_a_copy_the_driver_refuses_is_torchs_own_and_the_pushed_context_is_put_back(monkeypatch):
    lane, record, driver = _waiting_lane(monkeypatch, drained=True, codes={"cuMemcpyDtoHAsync_v2": 1}, pushed=True)
    monkeypatch.setattr(libcuda, "raise_for", _raise_for)
    assert _fast._offload(lane, _SizedBlock(), "cpu", 1 << 20) == "torch's"
    assert driver.events[-2:] == ["torch's", "leave"]
    assert [block.data_ptr() for block in _raw.PARKED] == [0xAB00]  # kept: where the call blocks, it may be enqueued


def test_a_failed_wait_after_the_copy_raises_the_drivers_error(monkeypatch):
    from syncless._core.errors import CudaError

    lane, record, driver = _waiting_lane(monkeypatch, drained=True, codes={"cuStreamSynchronize": 700}, pushed=True)
    monkeypatch.setattr(libcuda, "raise_for", _raise_for)
    with pytest.raises(CudaError, match="cuStreamSynchronize"):
        _fast._offload(lane, _SizedBlock(), "cpu", 1 << 20)
    assert driver.events[-1] == "leave" and "torch's" not in driver.events
    # the copy was enqueued into the result, which torch's host allocator knows nothing of: never given back
    assert [block.data_ptr() for block in _raw.PARKED] == [0xAB00]


def test_an_interrupt_between_the_copy_and_its_wait_keeps_the_result_and_puts_the_context_back(monkeypatch):
    lane, record, driver = _waiting_lane(monkeypatch, drained=True, pushed=True)

    blocking = driver.handle("blocking")

    class InterruptingSync:
        def __getattr__(self, name):
            if name == "cuStreamSynchronize":
                def interrupted(handle):
                    raise KeyboardInterrupt
                return interrupted
            return getattr(blocking, name)

    libcuda.LOADED[0] = (libcuda.LOADED[0][0], InterruptingSync())
    with pytest.raises(KeyboardInterrupt):
        _fast._offload(lane, _SizedBlock(), "cpu", 1 << 20)
    assert driver.events[-2:] == ["cuMemcpyDtoHAsync_v2", "leave"]
    assert [block.data_ptr() for block in _raw.PARKED] == [0xAB00]


def test_parked_results_are_bounded(monkeypatch):
    monkeypatch.setattr(_raw, "PARKED", [])
    monkeypatch.setattr(_raw, "_MAX_PARKED", 3)
    for block in range(5):
        _raw.park(block)
    assert _raw.PARKED == [2, 3, 4]  # the oldest go first


def _raise_for(call, code):
    from syncless._core.errors import CudaError

    raise CudaError(call, code, f"CUresult {code}", "a stand-in driver's error")


def test_where_the_host_does_not_wait_the_readback_is_still_torchs_own_copy(monkeypatch):
    lane, record, driver = _waiting_lane(monkeypatch, drained=True, emulating=False)
    assert _fast._offload(lane, _SizedBlock(), "cpu", 1 << 20) == "torch's"  # (it notes the copy for host writes)
    assert driver.events == ["query", "torch's"]


def test_torchs_own_read_at_the_call_enters_six_syncless_functions_under_emulation(monkeypatch):
    """``_read_back_now``, where the driver refused the raw copy: the read, two counters, the emulator's wait."""
    lane, record, log, queries = _readback_lane(monkeypatch, drained=True)
    record.stream = _Stream()
    lane.torch_to = lambda src, device, non_blocking: "copied"
    monkeypatch.setattr(_emulation, "_installed", True)
    waits = _emulated_driver(monkeypatch)
    names = _syncless_calls(lambda: _READ_BACK_NOW(lane, LaneBlock(), "cpu", record))
    assert names == ["_fast:_read_back_now", "_stats:left_alone", "_emulation:is_emulating",
                     "_streams:wait_stream_raw", "_stats:add"], names
    assert waits == [(0x51, True)]


_READ_BACK_NOW = _fast._read_back_now  # the real one (the lane fixture replaces it with a logger)


class _HostBlock(LaneBlock):
    """A pinned host tensor as the upload lane reads it: 8 bytes at a real address."""

    nbytes = 8
    shape = (1,)

    def __init__(self) -> None:
        import ctypes

        self._bytes = ctypes.create_string_buffer(b"\x07" * 8, 8)

    def stride(self):
        return (1,)

    def data_ptr(self):
        import ctypes

        return ctypes.addressof(self._bytes)


def test_the_inline_upload_enters_seven_syncless_functions(monkeypatch):
    """docs/cc.md gives the count (10 with the patch entry, the shim's wrapper and the lane's dispatch)."""
    import ctypes

    from syncless.cc import _inline_h2d

    launched = []

    class Quick:
        def cuCtxGetCurrent(self, handle):
            handle.value = 0xC0
            return 0

        def cuLaunchKernel(self, function, *rest):
            launched.append(function)
            return 0

    device_bytes = ctypes.create_string_buffer(8)
    landed = SimpleNamespace(data_ptr=lambda: ctypes.addressof(device_bytes))
    lane = SimpleNamespace(current_device=lambda: 0, capturing=lambda: False, raw_stream=lambda index: 7,
                           strided="strided", grad_enabled=lambda: True,
                           empty_strided=lambda shape, stride, dtype, device: landed)
    loaded = libcuda.LOADED[0]
    libcuda.LOADED[0] = (Quick(), None)  # the one list both hot paths read (put back below)
    monkeypatch.setitem(_raw._primary_handles, 0, 0xC0)
    monkeypatch.setitem(_inline_h2d._FUNCTIONS, 0, (11, 12, 13))
    monkeypatch.setattr(_inline_h2d, "_WORD_WRITES", {})  # the kernel, whatever an earlier test left
    monkeypatch.setattr(_d2h, "_PENDING", [0])
    from syncless.cc import _host_writes

    monkeypatch.setattr(_host_writes, "NOTED_STARTS", [])  # (an earlier test in this process may have left notes)
    src = _HostBlock()
    try:
        _inline_h2d.launch((11, 12, 13), landed.data_ptr(), src.data_ptr(), 8, 7)  # this thread's blocks, made once
        launched.clear()
        names = _syncless_calls(lambda: _fast._stage(lane, src, SimpleNamespace(index=0), 1 << 20, 4080))
    finally:
        libcuda.LOADED[0] = loaded
    assert names == ["_fast:_stage", "_inline_h2d:functions", "_fast:_inline", "_raw:enter_context",
                     "libcuda:current_context", "_inline_h2d:launch", "_stats:add"], names
    assert launched == [11]  # the 64-byte parameter block's entry
    block = _inline_h2d._local.blocks[0]
    assert bytes(block.buffer[16:24]) == b"\x07" * 8  # the payload: the source's bytes, read at the call

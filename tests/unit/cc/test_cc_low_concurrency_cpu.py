"""Issue 33, the host's cost at batch 1, on a CPU-only torch: the readback lane's look for a draining D2H stream,
the offloaded job's waits, and the patched ordering calls that go straight to torch with nothing to cover."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from syncless._core import libcuda, patching
from syncless.cc import _d2h, _emulation, _fast, _raw, _sync_patches, _worker
from syncless.cc._layers import SHIM_KEY

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


def test_a_drained_stream_is_read_back_now_with_one_query(monkeypatch):
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
    assert set(skipped) == {1}  # a skipped readback made one query (is it drained already?) and no look
    assert record.drain_skips <= _fast.MAX_DRAIN_SKIPS


def test_a_skipped_look_still_reads_back_now_from_a_stream_that_has_drained(monkeypatch):
    monkeypatch.setattr(_fast, "_clock", _Clock(1e-6))
    lane, record, _ = _lane_and_record(drained_after=0)
    record.drain_skips = 10
    assert _fast._drains_soon(lane, record)
    assert record.drain_skips == 10


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

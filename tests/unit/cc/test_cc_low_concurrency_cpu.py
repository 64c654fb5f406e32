"""Issue 33, the host's cost at batch 1, on a CPU-only torch: the readback lane's look for a draining D2H stream,
the offloaded job's one host wait, and the patched ordering calls that go straight to torch with nothing to cover."""

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


# -- the offloaded job: one host wait --------------------------------------------------------------------


class _Library:
    """A stand-in for one handle on libcuda: logs ``(handle, name)`` of each call, answers 0 (or ``answers``)."""

    def __init__(self, handle: str, log: list, answers: dict | None = None) -> None:
        self._handle, self._log, self._answers = handle, log, answers or {}

    def __getattr__(self, name: str):
        def call(*args):
            self._log.append((self._handle, name))
            return self._answers.get(name, 0)

        return call


def _run_job(monkeypatch, *, emulating: bool, finishes_at_call: bool, wait_on_gpu: bool, quick_answers=None):
    log: list = []
    quick, blocking = _Library("quick", log, quick_answers), _Library("blocking", log)
    monkeypatch.setattr(libcuda, "libraries", lambda: (quick, blocking))
    monkeypatch.setattr(_raw, "enter_context", lambda index: False)
    monkeypatch.setattr(_emulation, "is_emulating", lambda: emulating)
    monkeypatch.setattr(_raw, "COPIES_FINISH_AT_CALL", [finishes_at_call])
    _raw.run_copy_job(0, 11, 22, 33, 64, SimpleNamespace(cuda_stream=44), wait_on_gpu=wait_on_gpu)
    return log


def test_an_emulated_job_waits_once_on_the_host_for_its_ready_event_and_its_copy(monkeypatch):
    log = _run_job(monkeypatch, emulating=True, finishes_at_call=False, wait_on_gpu=True)
    assert log == [("quick", "cuStreamWaitEvent"), ("quick", "cuMemcpyDtoHAsync_v2"),
                   ("blocking", "cuStreamSynchronize")]


def test_under_confirmed_cc_the_copy_is_the_one_wait_and_a_query_confirms_it(monkeypatch):
    log = _run_job(monkeypatch, emulating=False, finishes_at_call=True, wait_on_gpu=True)
    assert log == [("quick", "cuStreamWaitEvent"), ("blocking", "cuMemcpyDtoHAsync_v2"), ("quick", "cuStreamQuery")]


def test_under_confirmed_cc_a_copy_stream_still_busy_after_the_copy_is_waited_for(monkeypatch):
    log = _run_job(monkeypatch, emulating=False, finishes_at_call=True, wait_on_gpu=True,
                   quick_answers={"cuStreamQuery": libcuda.CUDA_ERROR_NOT_READY})
    assert log[-2:] == [("quick", "cuStreamQuery"), ("blocking", "cuStreamSynchronize")]


def test_without_cc_or_emulation_the_copy_lets_go_of_the_gil(monkeypatch):
    """A copy that may block (CC forced on, unconfirmed) never holds the GIL while it runs."""
    log = _run_job(monkeypatch, emulating=False, finishes_at_call=False, wait_on_gpu=True)
    assert log == [("quick", "cuStreamWaitEvent"), ("blocking", "cuMemcpyDtoHAsync_v2"),
                   ("blocking", "cuStreamSynchronize")]


def test_a_shared_copy_stream_gets_no_gpu_side_wait(monkeypatch):
    """On a copy stream other D2H streams use too, a GPU-side wait would hold their copies behind this producer."""
    log = _run_job(monkeypatch, emulating=True, finishes_at_call=False, wait_on_gpu=False,
                   quick_answers={"cuEventQuery": libcuda.CUDA_ERROR_NOT_READY})
    assert ("quick", "cuStreamWaitEvent") not in log
    assert log[:2] == [("quick", "cuEventQuery"), ("blocking", "cuEventSynchronize")]


def test_a_d2h_streams_job_waits_on_its_own_copy_stream(monkeypatch):
    """The offload hands the job the stream's own copy stream, and says so (the GPU-side wait is safe there)."""
    made = []

    class Job:
        nbytes = 0
        settled = None

        def __init__(self, *args, **options):
            made.append(options)

        def __call__(self):
            pass

    monkeypatch.setattr(_d2h._d2h_job, "CopyJob", Job)
    monkeypatch.setattr(_raw, "take_ready_event", lambda index: 7)
    monkeypatch.setattr(_raw, "record_ready", lambda event, stream: None)
    monkeypatch.setattr(_d2h._host_writes, "note_offloaded_d2h", lambda dst, ticket: None)
    monkeypatch.setattr(_d2h._streams, "worker_stream", lambda index: object())
    worker = _worker.OrderedWorker("test-own-copy-stream")
    try:
        for record in (_d2h._D2HStream(object(), worker=worker, copy_stream=object()),
                       _d2h._D2HStream(object(), worker=worker)):
            _d2h._queue(record, object(), object(), object(), "copy", False, 0)
        worker.wait_for(worker.submitted)  # (run here; each lowers the pending count as it ends)
    finally:
        worker.shutdown(1.0)
    assert [options["own_stream"] for options in made] == [True, False]


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

"""The D2H offload's ordering bookkeeping on a CPU-only torch (recording stand-ins for the CUDA calls).

What is under test is which stream the ready event goes on: the D2H stream
itself (so every ``wait_stream`` and ``wait_event`` it saw is covered, not
one remembered producer); that nothing else is enqueued on the D2H stream
(no GPU-side wait on the worker, which deadlocked when streams shared a
hardware queue); that the worker waits for the ready event, copies and
waits for its copy; and the host-side ordering after the copy (the stream's
last job, waits on events stamped with it). Issue 14's bugs (a) and (b)
were the ready event recorded on the last ``wait_stream`` producer.
"""

from __future__ import annotations

import contextlib
import os
import time
import ctypes
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch

import syncless.cc as cc
from syncless._core.errors import SynclessError
from syncless.cc import _d2h, _d2h_job, _raw, _streams
from syncless.cc._worker import D2HCopyError, OrderedWorker


class _Ready:
    """Stands in for a torch.cuda.Event (making a real one needs a GPU)."""

    count = 0

    def __init__(self):
        _Ready.count += 1
        self.name = f"R{_Ready.count}"


@pytest.fixture(autouse=True)
def _offloading_open():
    """These tests call the offload directly, without ``install()``, which is what opens it after an uninstall."""
    _d2h.resume_offloading()
    _d2h._last_jobs.clear()  # the stand-in streams below are not registered: their jobs are forgotten after each test
    _d2h._COVER[0] = ()
    yield
    _d2h.resume_offloading()
    _d2h._last_jobs.clear()
    _d2h._COVER[0] = ()


@pytest.fixture
def gpu_calls(monkeypatch):
    """Replace the thin CUDA helpers by recorders; return the shared log."""
    log: list[tuple] = []
    lock = threading.Lock()

    def note(*entry):
        with lock:
            log.append(entry)

    worker_stream = SimpleNamespace(name="W", device=torch.device("cuda", 0), cuda_stream=99)
    monkeypatch.setattr(torch.cuda, "Event", _Ready)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(_streams, "worker_stream", lambda index: worker_stream)
    monkeypatch.setattr(_streams, "record_event_raw", lambda event, stream: note("record", event.name, stream.name))
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: note("worker waits", event.name))
    monkeypatch.setattr(_streams, "wait_stream_raw", lambda stream: note("worker drains", stream.name))
    stand_in_raw_driver(monkeypatch)
    worker = OrderedWorker("test-d2h")
    monkeypatch.setattr(_d2h, "OrderedWorker", lambda name="syncless-d2h": worker)  # every stand-in stream's
    yield log, worker
    worker.shutdown(5.0)


def stand_in_raw_driver(monkeypatch):
    """The driver calls of the offload and its job (:mod:`syncless.cc._raw`) on CPU memory, routed through the
    ``_streams`` stand-ins above (looked up at each call, so a test that replaces one of those holds the job)."""
    monkeypatch.setattr(_raw, "InContext", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_raw, "take_ready_event", lambda index: torch.cuda.Event())
    monkeypatch.setattr(_raw, "give_back_ready_event", lambda index, event: None)
    monkeypatch.setattr(_raw, "record_ready", lambda event, stream: _streams.record_event_raw(event, stream))
    monkeypatch.setattr(_raw, "copy_device_block",
                        lambda index, dst_ptr, src_ptr, nbytes, stream: ctypes.memmove(dst_ptr, src_ptr, nbytes))

    def run_copy_job(index, ready, host_ptr, device_ptr, nbytes, stream):
        _streams.wait_event_raw(ready)
        ctypes.memmove(host_ptr, device_ptr, nbytes)
        _streams.wait_stream_raw(stream)

    monkeypatch.setattr(_raw, "run_copy_job", run_copy_job)


def _d2h_stream(name="D"):
    return _d2h._D2HStream(SimpleNamespace(name=name, device=torch.device("cuda", 0), device_index=0))


def test_ready_event_goes_on_the_d2h_stream_and_nothing_else(gpu_calls):
    log, worker = gpu_calls
    record = _d2h_stream()
    src, dst = torch.randn(32), torch.full((32,), float("nan"))
    # Whatever the caller did on D before (wait_stream(p1), wait_stream(p2), wait_event(e), a kernel on D), all of
    # it is in D's queue in front of the ready event: the worker waits for D, never for one producer.
    seq = _d2h.offload(record, dst, src, "copy", into_existing=True)
    worker.wait_and_raise(seq, timeout_s=5.0)
    assert torch.equal(dst, src)
    assert record.last_job == seq
    ready = log[0][1]
    assert log == [
        ("record", ready, "D"),       # on the D2H stream itself, and nothing else is enqueued there
        ("worker waits", ready),
        ("worker drains", "W"),       # the job is done only once its copy is
    ]


def test_the_copy_reads_the_source_as_it_was_at_the_call(gpu_calls, monkeypatch):
    """A kernel queued on D after the copy (here: the host writes while the worker is held) cannot reach it.

    torch orders such a kernel after its own copy on D; the offload reads the source into a snapshot at the
    call, on D, and the worker copies the snapshot. (It used to copy the source itself, after the kernel.)
    """
    log, worker = gpu_calls
    hold = threading.Event()
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: hold.wait(5))  # the ready event has not fired
    record = _d2h_stream()
    src = torch.randn(64)
    old = src.clone()
    dst = torch.full((64,), float("nan"))
    seq = _d2h.offload(record, dst, src, "copy", into_existing=True)
    src.zero_()  # "x.zero_() on D after the copy"
    hold.set()
    worker.wait_and_raise(seq, timeout_s=5.0)
    assert torch.equal(dst, old)


def test_no_room_for_the_snapshot_offloads_nothing(gpu_calls, monkeypatch):
    log, worker = gpu_calls

    def no_room(src, dst, stream):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(_d2h_job, "snapshot", no_room)
    record = _d2h_stream()
    assert _d2h.offload(record, torch.empty(4), torch.randn(4), "copy", into_existing=True) == 0
    assert worker.submitted == 0 and record.last_job == 0 and log == []  # the caller runs torch's own copy


def test_failed_copy_surfaces_and_still_counts_as_finished(gpu_calls, monkeypatch):
    log, worker = gpu_calls

    def driver_fails(stream):
        raise RuntimeError("cuStreamSynchronize failed (stand-in)")

    monkeypatch.setattr(_streams, "wait_stream_raw", driver_fails)  # the worker's wait for its copy fails
    record = _d2h_stream()
    seq = _d2h.offload(record, torch.empty(5), torch.randn(5), "bad copy", into_existing=True)
    with pytest.raises(D2HCopyError, match="bad copy"):
        worker.wait_and_raise(seq, timeout_s=5.0)
    assert not worker.is_pending(seq)  # a host wait ordered after it never hangs


def test_each_stream_numbers_its_own_last_job_across_threads(gpu_calls):
    log, worker = gpu_calls
    streams = [_d2h_stream(f"D{i}") for i in range(4)]
    seqs: dict[str, list[int]] = {r.stream.name: [] for r in streams}

    def issue(record):
        for _ in range(25):
            seqs[record.stream.name].append(_d2h.offload(record, torch.empty(4), torch.randn(4), "copy", into_existing=True))

    threads = [threading.Thread(target=issue, args=(r,)) for r in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    worker.wait_and_raise(worker.submitted, timeout_s=30.0)
    records = [e for e in log if e[0] == "record"]
    assert len(records) == 100 and sorted(n for got in seqs.values() for n in got) == list(range(1, 101))
    for record in streams:
        assert record.last_job == max(seqs[record.stream.name])


def test_waiting_on_an_event_stamped_by_a_d2h_stream_waits_for_its_copies(gpu_calls, monkeypatch):
    from syncless.cc import _sync_patches

    log, worker = gpu_calls
    record = _d2h_stream()
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 7): record})
    monkeypatch.setattr(_d2h, "lookup", lambda stream: record if stream is record.stream else None)
    hold = threading.Event()
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: hold.wait(5))  # the copy's producer still runs
    seq = _d2h.offload(record, torch.empty(4), torch.randn(4), "copy", into_existing=True)
    event = SimpleNamespace()
    _sync_patches._mark(event)  # recorded (on any stream) after the copy's call
    assert getattr(event, _sync_patches._MARK) == ((record.worker, seq),)
    released = threading.Timer(0.2, hold.set)
    released.start()
    _sync_patches._wait_marked(event)  # P.wait_event(e) / P.wait_stream(D): the host waits first
    assert not worker.is_pending(seq)
    released.join()


def test_new_d2h_stream_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SynclessError, match=r"needs a CUDA GPU.*is_available\(\) is False"):
        cc.new_d2h_stream()


_SOURCES_4D = ["contiguous", "channels_last", "channels_last slice", "channels_last, one channel"]
_SOURCES_2D = ["transposed", "column transposed", "empty"]


@pytest.mark.parametrize(("source", "memory_format"), [
    (source, memory_format)
    for source in _SOURCES_4D + _SOURCES_2D
    for memory_format in (None, torch.preserve_format, torch.contiguous_format, torch.channels_last)
    if memory_format is not torch.channels_last or source in _SOURCES_4D  # channels_last asks for 4 dims
])
def test_an_offloaded_to_result_has_torchs_layout_and_is_pinned(monkeypatch, source, memory_format):
    """``x.to("cpu", non_blocking=True)``'s result: the strides torch's own copy gives, in pinned memory.

    The review found a non-dense source given contiguous strides (torch infers dense strides in the source's
    order) and ``memory_format=channels_last`` made by ``.contiguous()``, which returns pageable memory.
    """
    pinned = []

    def keep(make):
        def allocate(*args, pin_memory=False, **kwargs):
            pinned.append(pin_memory)
            return make(*args, **kwargs)  # no pinned allocator on a CPU-only build
        return allocate

    monkeypatch.setattr(torch, "empty", keep(torch.empty))
    monkeypatch.setattr(torch, "empty_strided", keep(torch.empty_strided))
    base = torch.randn(2, 3, 4, 5)
    x = {
        "contiguous": base,
        "transposed": base[0, 0].t(),
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "channels_last slice": base.contiguous(memory_format=torch.channels_last)[..., :3],
        # contiguous, with odd strides on size-1 dims, which torch's copy keeps (found in review)
        "channels_last, one channel": torch.randn(2, 1, 4, 4).contiguous(memory_format=torch.channels_last),
        "column transposed": torch.randn(1, 6).t(),
        "empty": torch.randn(0, 3).t(),
    }[source]
    kwargs = {} if memory_format is None else {"memory_format": memory_format}
    result = _d2h.pinned_like(x, torch.float64, memory_format)
    expected = x.to("meta", torch.float64, **kwargs)  # torch's own _to_copy layout
    assert result.dtype == torch.float64 and result.shape == x.shape and result.stride() == expected.stride()
    assert pinned and all(pinned)


def test_the_destination_version_is_bumped_at_the_call_once(gpu_calls, monkeypatch):
    """torch bumps the destination's version when the copy is issued (autograd's saved-tensor check reads it);
    the worker's later write must not bump it again (found in review: it bumped it later, on the worker)."""
    log, worker = gpu_calls
    hold = threading.Event()
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: hold.wait(5))
    dst = torch.full((16,), float("nan"))
    src = torch.randn(16)
    before = dst._version
    seq = _d2h.offload(_d2h_stream(), dst, src, "copy", into_existing=True)
    assert dst._version == before + 1  # at the call, the worker still held
    hold.set()
    worker.wait_and_raise(seq, timeout_s=5.0)
    assert dst._version == before + 1 and torch.equal(dst, src)


def test_no_offload_slips_in_while_uninstall_drains(gpu_calls):
    """Once ``uninstall()`` starts draining, a thread still inside a wrapper runs torch's own copy instead."""
    log, worker = gpu_calls
    _d2h.stop_offloading()
    try:
        assert _d2h.offload(_d2h_stream(), torch.empty(4), torch.randn(4), "copy", into_existing=True) == 0
        assert worker.submitted == 0 and log == []
    finally:
        _d2h.resume_offloading()
    assert _d2h.offload(_d2h_stream(), torch.empty(4), torch.randn(4), "copy", into_existing=True) == 1


def test_each_d2h_stream_has_its_own_worker(monkeypatch):
    """A copy offloaded from one D2H stream does not wait behind another stream's copy that waits for a slow
    producer (found in review: one worker served every stream in issue order, which could deadlock two host
    threads and delayed, say, a token readback behind a KV-cache offload)."""
    monkeypatch.setattr(torch.cuda, "Event", _Ready)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(_streams, "worker_stream", lambda index: SimpleNamespace(name="W", cuda_stream=99))
    monkeypatch.setattr(_streams, "record_event_raw", lambda event, stream: None)
    monkeypatch.setattr(_streams, "wait_stream_raw", lambda stream: None)
    slow_ready = threading.Event()

    class SlowReady(_Ready):
        """The ready event of a copy whose producer has not finished until ``slow_ready`` is set."""

    def wait_event(event):
        if isinstance(event, SlowReady):
            slow_ready.wait(10)

    monkeypatch.setattr(_streams, "wait_event_raw", wait_event)
    stand_in_raw_driver(monkeypatch)
    slow, fast = _d2h_stream("slow"), _d2h_stream("fast")
    assert slow.worker is not fast.worker
    try:
        monkeypatch.setattr(torch.cuda, "Event", SlowReady)
        _d2h.offload(slow, torch.empty(4), torch.randn(4), "slow copy", into_existing=True)
        monkeypatch.setattr(torch.cuda, "Event", _Ready)
        dst, src = torch.full((4,), float("nan")), torch.randn(4)
        seq = _d2h.offload(fast, dst, src, "fast copy", into_existing=True)
        fast.worker.wait_and_raise(seq, timeout_s=5.0)  # done while the slow stream's copy still waits
        assert torch.equal(dst, src) and slow.worker.is_pending(slow.last_job) and _d2h.pending()
        with pytest.raises(Exception, match="unfinished"):  # a synchronize of the slow stream still waits for it
            slow.worker.wait_for(slow.last_job, timeout_s=0.2)
    finally:
        slow_ready.set()
        slow.worker.wait_and_raise(slow.last_job, timeout_s=5.0)
        for worker in (slow.worker, fast.worker):
            worker.shutdown(5.0)
    assert not _d2h.pending()


def test_a_conjugate_view_destination_gets_torchs_values(gpu_calls):
    """``h.conj().copy_(x)`` writes conj(x) into h's memory, so the view reads x; a plain alias of the storage
    would lose the conjugate bit and leave the view reading conj(x)."""
    log, worker = gpu_calls
    host = torch.zeros(8, dtype=torch.complex64)
    view = host.conj()
    src = torch.randn(8, dtype=torch.complex64)
    seq = _d2h.offload(_d2h_stream(), view, src, "copy", into_existing=True)
    worker.wait_and_raise(seq, timeout_s=5.0)
    assert torch.equal(view, src) and torch.equal(host, src.conj())



class _Sync:
    """The patched torch.cuda.Event record/synchronize/query/wait, over stand-in events whose GPU side is done.

    Made while ``gpu_calls`` has replaced torch.cuda.Event by ``_Ready``, so the wrappers take ``_Ready`` events.
    """

    def __init__(self):
        from syncless.cc import _sync_patches

        self.record = _sync_patches._wrap_event_record(lambda event, stream=None: None)
        self.synchronize = _sync_patches._wrap_event_synchronize(lambda event: None)
        self.query = _sync_patches._wrap_event_query(lambda event: True)
        self.gpu_waits = []
        self.wait = _sync_patches._wrap_event_wait(lambda event, stream=None: self.gpu_waits.append(stream))


@pytest.mark.parametrize("how", ["synchronize", "query", "wait"])
def test_an_event_recorded_on_an_ordinary_stream_after_the_copy_covers_it(gpu_calls, monkeypatch, how):
    """Issue 24 item 3: the seed's rule. An event recorded on any stream after an offloaded copy's call covers the
    copy at synchronize, query and a wait on it (under CC without the shim the copy had finished at the call).
    Before the fix only events recorded on the D2H stream were stamped, and this one returned before the copy."""
    log, worker = gpu_calls
    hold = threading.Event()
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: hold.wait(5))  # the copy's producer still runs
    record = _d2h_stream()
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 7): record})
    sync = _Sync()
    dst, src = torch.full((16,), float("nan")), torch.randn(16)
    seq = _d2h.offload(record, dst, src, "copy", into_existing=True)
    event = _Ready()
    sync.record(event, SimpleNamespace(name="S0"))  # an ordinary stream, after the copy's call
    if how == "query":
        assert sync.query(event) is False  # the copy is not done: the event must not say it is
        hold.set()
        worker.wait_for(seq, timeout_s=5.0)
        assert sync.query(event) is True and torch.equal(dst, src)
        return
    releaser = threading.Timer(0.2, hold.set)
    releaser.start()
    if how == "synchronize":
        sync.synchronize(event)
    else:
        sync.wait(event, "P")  # P.wait_event(e): the host waits for the copy before the GPU wait
        assert sync.gpu_waits == ["P"]
    assert not worker.is_pending(seq) and torch.equal(dst, src)
    releaser.join()


def test_an_event_recorded_before_the_copy_does_not_wait_for_it(gpu_calls, monkeypatch):
    """Only copies issued before the record are covered: an older event stays torch's own."""
    log, worker = gpu_calls
    hold = threading.Event()
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: hold.wait(5))
    record = _d2h_stream()
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 7): record})
    sync = _Sync()
    event = _Ready()
    sync.record(event, SimpleNamespace(name="S0"))
    try:
        seq = _d2h.offload(record, torch.empty(4), torch.randn(4), "copy", into_existing=True)
        assert sync.query(event) is True  # recorded before the copy's call
        sync.synchronize(event)
        assert worker.is_pending(seq)
    finally:
        hold.set()


def test_an_offload_racing_uninstall_is_refused_even_after_uninstall_returns(gpu_calls, monkeypatch):
    """Issue 27 item 3: a thread inside a wrapper, held in the pinned allocation while uninstall() ran from start to
    end, used to submit its job afterwards (uninstall cleared the closing flag again); torch's own synchronizes were
    back by then and none covered the job. Now offloading stays refused until the next install()."""
    log, worker = gpu_calls
    entered, release = threading.Event(), threading.Event()
    real_snapshot = _d2h_job.snapshot

    def held_snapshot(src, dst, stream):
        entered.set()
        release.wait(5)  # "blocked in the pinned allocation"
        return real_snapshot(src, dst, stream)

    monkeypatch.setattr(_d2h_job, "snapshot", held_snapshot)
    results = []
    caller = threading.Thread(target=lambda: results.append(
        _d2h.offload(_d2h_stream(), torch.empty(4), torch.randn(4), "copy", into_existing=True)))
    caller.start()
    assert entered.wait(5)
    cc.uninstall(timeout_s=5.0)  # the whole of it, while the caller is held
    release.set()
    caller.join(5)
    assert results == [0] and worker.submitted == 0  # declined: the caller runs torch's own copy


def test_an_offload_after_the_worker_shut_down_at_exit_is_torchs_own_copy(gpu_calls):
    """Issue 27 item 5: atexit runs the last registered first, so a D2H in an atexit handler registered before the
    worker's ran after the worker's shutdown, and Tensor.to raised "...shut down" where torch would copy."""
    log, worker = gpu_calls
    worker.shutdown(1.0)
    assert _d2h.offload(_d2h_stream(), torch.empty(4), torch.randn(4), "copy", into_existing=True) == 0
    assert worker.submitted == 0


def test_a_capture_begins_after_the_queued_copies_and_nothing_is_offloaded_while_it_is_open(gpu_calls, monkeypatch):
    """Issue 27 item 7: jobs pending at a direct ``CUDAGraph.capture_begin()``, or an offload while another thread
    (or the capturing one, on a D2H stream outside the capture) captures, made the worker synchronize during a global
    capture, which invalidates it. Now capture_begin first waits for the queued copies, and while any capture is
    open no copy is offloaded (the caller runs torch's own) and the emulator makes no wait."""
    from syncless.cc import _sync_patches

    log, worker = gpu_calls
    hold = threading.Event()
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: hold.wait(5))
    record = _d2h_stream()
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 7): record})
    seq = _d2h.offload(record, torch.empty(4), torch.randn(4), "copy", into_existing=True)
    began = []
    begin = _sync_patches._wrap_capture_begin(lambda graph: began.append(worker.is_pending(seq)))
    end = _sync_patches._wrap_capture_end(lambda graph: None)
    graph = object()
    releaser = threading.Timer(0.2, hold.set)
    releaser.start()
    try:
        begin(graph)
        assert began == [False]  # the capture began only once the queued copy was done
        assert _streams.any_current_capture(0)  # a capture is open (on any thread): the shim leaves copies alone
        assert _d2h.offload(record, torch.empty(4), torch.randn(4), "copy", into_existing=True) == 0
        end(graph)
        assert not _streams.CAPTURES[0]
        assert _d2h.offload(record, torch.empty(4), torch.randn(4), "copy", into_existing=True) == seq + 1
    finally:
        releaser.join()
        _streams.forget_captures()


@pytest.mark.parametrize("via", ["setitem", "new_tensor", "storage_copy"])
def test_a_copy_that_bypasses_the_wrappers_on_a_d2h_stream_waits_for_its_offloaded_copies(gpu_calls, monkeypatch,
                                                                                           via):
    """Issue 27 item 1: ``h.copy_(a, non_blocking=True); h[:] = b`` on a D2H stream. torch runs ``h[:] = b`` in
    D's order after the first copy, so h is b; with the shim the worker wrote a later (``h[:] = b`` goes through
    torch's C++ copy, not the patched ``copy_``). It now waits for D's offloaded copies first."""
    from syncless.cc import _bypass

    log, worker = gpu_calls
    hold = threading.Event()
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: hold.wait(5))  # the first copy is late
    stream = SimpleNamespace(name="D", device=torch.device("cuda", 0), cuda_stream=7)
    record = _d2h._D2HStream(stream)
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 7): record})
    monkeypatch.setattr(_streams, "current_stream", lambda index: stream)  # D is current
    monkeypatch.setattr(_bypass, "_crosses", lambda a, b: True)  # "b is on the GPU" (a CPU build has no GPU)
    a, b = torch.randn(64), torch.randn(64)
    h = torch.full((64,), float("nan"))
    _d2h.offload(record, h, a, "h.copy_(a, non_blocking=True)", into_existing=True)
    releaser = threading.Timer(0.2, hold.set)
    releaser.start()
    if via == "setitem":
        _bypass._wrap_setitem(torch.Tensor.__setitem__)(h, slice(None), b)
    elif via == "new_tensor":
        made = _bypass._wrap_settling(torch.Tensor.new_tensor)(b, h)  # reads h: after the first copy wrote it
        assert torch.equal(made, a)
        h.copy_(b)
    else:
        _bypass._wrap_settling(torch.UntypedStorage.copy_)(h.untyped_storage(), b.untyped_storage())
    releaser.join()
    worker.wait_for(worker.submitted, timeout_s=5.0)
    assert torch.equal(h, b), "the offloaded copy landed after the later copy"
    from syncless.cc._stats import COUNTERS
    assert COUNTERS.snapshot().bypass_waits >= 1


def test_an_assignment_that_stays_on_one_side_never_waits():
    from syncless.cc import _bypass

    assert not _bypass._crosses(torch.zeros(2), torch.ones(2))
    assert not _bypass._crosses(torch.zeros(2), 1.0)


def test_a_d2h_stream_can_be_closed_and_gives_back_what_it_held(gpu_calls, monkeypatch):
    """Issue 27 item 8: each new_d2h_stream() kept a stream, a context retain, an OS thread and an atexit entry
    forever; one per request grew without bound. close_d2h_stream() waits for its copies and releases them all."""
    import atexit

    log, worker = gpu_calls
    made = SimpleNamespace(name="D", device=torch.device("cuda", 0), cuda_stream=31)
    unregistered = []
    monkeypatch.setattr(_d2h, "_require_cuda", lambda: None)
    monkeypatch.setattr(_streams, "device_index", lambda device: 0)
    copy_stream = SimpleNamespace(name="W'", device=torch.device("cuda", 0), cuda_stream=32)
    created = iter([made, copy_stream])
    monkeypatch.setattr(_streams, "create_private_stream", lambda index: next(created))
    monkeypatch.setattr(_d2h, "_released_pairs", {})
    monkeypatch.setattr(_streams, "current_stream", lambda index: SimpleNamespace(cuda_stream=1))
    real_unregister = atexit.unregister
    monkeypatch.setattr(atexit, "unregister", lambda fn: (unregistered.append(fn), real_unregister(fn)))
    monkeypatch.setattr(_d2h, "_streams_by_key", {})
    stream = cc.new_d2h_stream()
    record = _d2h.lookup(stream)
    hold = threading.Event()
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: hold.wait(5))
    dst, src = torch.full((8,), float("nan")), torch.randn(8)
    seq = _d2h.offload(record, dst, src, "copy", into_existing=True)
    assert worker._thread.is_alive()
    releaser = threading.Timer(0.2, hold.set)
    releaser.start()
    cc.close_d2h_stream(stream)
    releaser.join()
    assert not worker.is_pending(seq) and torch.equal(dst, src)  # its copies finished first
    assert not cc.is_d2h_stream(stream) and _d2h._released_pairs == {0: [(made, copy_stream)]}
    assert not worker._thread.is_alive() and worker.shutdown in unregistered
    assert _d2h.offload(record, torch.empty(4), torch.randn(4), "copy", into_existing=True) == 0  # a late caller: torch's own copy
    with pytest.raises(ValueError, match="not an open stream"):
        cc.close_d2h_stream(stream)
    # The next D2H stream reuses the CUDA streams (never destroyed: torch's allocators may still record events
    # on them); `created` is spent, so a new CUDA stream here would raise StopIteration.
    again = cc.new_d2h_stream()
    assert again is made and _d2h.lookup(again).copy_stream is copy_stream and _d2h._released_pairs == {0: []}


def test_closing_the_current_d2h_stream_is_refused(monkeypatch):
    stream = SimpleNamespace(device=torch.device("cuda", 0), cuda_stream=41)
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 41): _d2h._D2HStream(stream)})
    monkeypatch.setattr(_streams, "current_stream", lambda index: stream)
    with pytest.raises(ValueError, match="is the current stream"):
        cc.close_d2h_stream(stream)
    with pytest.raises(TypeError, match="timeout_s"):
        cc.close_d2h_stream(stream, timeout_s="x")


@pytest.mark.parametrize("kind", ["conj", "neg", "conj+neg"])
def test_a_conjugate_or_negative_destination_gets_torchs_values_and_one_version_bump(gpu_calls, kind):
    """docs/cc.md review: such a destination was written through itself, so its version was bumped twice (at the
    call, and by the worker's write); torch bumps it once."""
    log, worker = gpu_calls
    host = torch.zeros(8, dtype=torch.complex64)
    view = host
    if "conj" in kind:
        view = view.conj()
    if "neg" in kind:
        view = torch._neg_view(view)
    src = torch.randn(8, dtype=torch.complex64)
    expected_host = host.clone()
    expected_view = expected_host.conj() if "conj" in kind else expected_host
    if "neg" in kind:
        expected_view = torch._neg_view(expected_view)
    expected_view.copy_(src)  # torch's own copy into the same kind of view
    before = view._version
    seq = _d2h.offload(_d2h_stream(), view, src, "copy", into_existing=True)
    worker.wait_and_raise(seq, timeout_s=5.0)
    assert torch.equal(host, expected_host) and torch.equal(view.resolve_conj().resolve_neg(), src)
    assert view._version == before + 1


def test_each_d2h_stream_copies_on_a_stream_of_its_own(gpu_calls, monkeypatch):
    """docs/cc.md review: one worker stream per GPU was shared by every worker, so a job's wait for its copy (and
    under CC the driver's copy) waited for other D2H streams' transfers too."""
    log, worker = gpu_calls
    made = iter([SimpleNamespace(name=name, device=torch.device("cuda", 0), cuda_stream=number)
                 for number, name in enumerate(["D", "W-D", "E", "W-E"], 50)])
    monkeypatch.setattr(_d2h, "_require_cuda", lambda: None)
    monkeypatch.setattr(_streams, "device_index", lambda device: 0)
    monkeypatch.setattr(_streams, "create_private_stream", lambda index: next(made))
    monkeypatch.setattr(_d2h, "_streams_by_key", {})
    for stream in (cc.new_d2h_stream(), cc.new_d2h_stream()):
        seq = _d2h.offload(_d2h.lookup(stream), torch.empty(4), torch.randn(4), "copy", into_existing=True)
        worker.wait_and_raise(seq, timeout_s=5.0)
    assert [entry for entry in log if entry[0] == "worker drains"] == [("worker drains", "W-D"),
                                                                        ("worker drains", "W-E")]


def test_the_snapshot_is_converted_and_broadcast_on_the_d2h_stream(gpu_calls, monkeypatch):
    """Issue 27 item 4's realistic cause: the worker converted a bf16 source to fp32 itself, and a GPU temporary
    that found no room failed the copy late. The snapshot now has the destination's dtype and layout (its
    allocation is the one the no-room fallback covers), so the worker's copy is one plain block."""
    log, worker = gpu_calls
    copied = []
    real_job = _d2h_job.CopyJob

    def spy(index, ready, dst, snap, copy_stream, verb, src):
        copied.append((snap.dtype, tuple(snap.shape), snap.stride()))
        return real_job(index, ready, dst, snap, copy_stream, verb, src)

    monkeypatch.setattr(_d2h_job, "CopyJob", spy)
    dst = torch.full((4, 8), float("nan"))
    src = torch.randn(8).to(torch.bfloat16)  # broadcast over the rows, converted to fp32
    seq = _d2h.offload(_d2h_stream(), dst, src, "copy", into_existing=True)
    worker.wait_and_raise(seq, timeout_s=5.0)
    assert copied == [(torch.float32, (4, 8), (8, 1))]
    assert torch.equal(dst, src.float().expand(4, 8))


def test_a_fresh_to_result_keeps_version_0_and_an_existing_target_is_bumped_once(gpu_calls):
    """Issue 33 item 8: a fresh offloaded ``.to()`` result had ``_version`` 1 (bumped as if it were a ``copy_``);
    torch's own fresh result has 0."""
    log, worker = gpu_calls
    src = torch.randn(16)
    fresh = torch.empty(16)
    seq = _d2h.offload(_d2h_stream(), fresh, src, ".to('cpu', non_blocking=True)", into_existing=False)
    worker.wait_and_raise(seq, timeout_s=5.0)
    assert fresh._version == 0 and torch.equal(fresh, src)
    assert torch.empty(16)._version == 0 == src.to("cpu")._version  # what torch gives a new tensor
    existing = torch.zeros(16)
    seq = _d2h.offload(_d2h_stream(), existing, src, "copy_(non_blocking=True)", into_existing=True)
    worker.wait_and_raise(seq, timeout_s=5.0)
    assert existing._version == 1 and torch.equal(existing, src)


def test_two_concurrent_closes_of_one_stream_pool_it_once(gpu_calls, monkeypatch):
    """Issue 33 item 5: two close_d2h_stream(d) calls at once both went on and pooled the same CUDA stream twice,
    so the next two new_d2h_stream() calls returned one stream. The second is refused while the first runs."""
    log, worker = gpu_calls
    made = SimpleNamespace(name="D", device=torch.device("cuda", 0), cuda_stream=61)
    copy_stream = SimpleNamespace(name="W'", device=torch.device("cuda", 0), cuda_stream=62)
    created = iter([made, copy_stream])
    monkeypatch.setattr(_d2h, "_require_cuda", lambda: None)
    monkeypatch.setattr(_streams, "device_index", lambda device: 0)
    monkeypatch.setattr(_streams, "create_private_stream", lambda index: next(created))
    monkeypatch.setattr(_d2h, "_released_pairs", {})
    monkeypatch.setattr(_streams, "current_stream", lambda index: SimpleNamespace(cuda_stream=1))
    monkeypatch.setattr(_d2h, "_streams_by_key", {})
    stream = cc.new_d2h_stream()
    hold = threading.Event()
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: hold.wait(5))
    _d2h.offload(_d2h.lookup(stream), torch.empty(8), torch.randn(8), "copy", into_existing=True)
    first = threading.Thread(target=cc.close_d2h_stream, args=(stream,))
    first.start()
    deadline = time.monotonic() + 5
    while not _d2h.lookup(stream).closing and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(ValueError, match="already being closed"):
        cc.close_d2h_stream(stream)
    hold.set()
    first.join(5)
    assert not first.is_alive()
    assert _d2h._released_pairs == {0: [(made, copy_stream)]}  # pooled once
    assert cc.new_d2h_stream() is made
    with pytest.raises(StopIteration):  # the pool is empty: a second stream is a new one, never the same again
        cc.new_d2h_stream()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_has_nothing_pending_and_its_as_tensor_touches_no_cuda(monkeypatch):
    """Issue 33 item 6: a child forked with a copy pending inherited the count and no worker thread; its
    ``torch.as_tensor`` (a DataLoader worker collating numpy batches) then asked CUDA for the current stream."""
    import numpy as np

    from syncless.cc import _bypass

    record = _d2h._D2HStream(SimpleNamespace(name="D", device=torch.device("cuda", 0), cuda_stream=71))
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 71): record})
    monkeypatch.setattr(_d2h, "_PENDING", [3])
    monkeypatch.setattr(_d2h, "_FORK_LEFTOVERS", [])
    gate = threading.Event()

    class Holds:
        """Stands in for what a queued job holds (a device snapshot, an event): freed in a child, CUDA aborts it."""

    def queue_a_job():
        held = Holds()
        record.worker.submit(lambda: (gate.wait(10), held), eager=False)
        return weakref.ref(held)

    held_ref = queue_a_job()
    touched = []
    monkeypatch.setattr(_streams, "current_stream", lambda index: touched.append(index))
    as_tensor = _bypass._wrap_settling(torch.as_tensor)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once (no atexit, no pytest)
        try:
            value = as_tensor(np.arange(3)).tolist()
            kept = held_ref() is not None  # the job's holdings were not released in the child
            answer = f"{_d2h._PENDING[0]} {len(_d2h._streams_by_key)} {len(touched)} {value} {kept}"
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            answer = f"error {err!r}"
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 1000).decode()
    os.close(read)
    assert os.WIFEXITED(status) and answer == "0 0 0 [0, 1, 2] True", answer
    assert _d2h._PENDING[0] == 3 and _d2h._streams_by_key  # the parent's own state is untouched
    gate.set()
    record.worker.wait_for(record.worker.submitted)
    record.worker.shutdown(5)

"""Issue 33, the review round of session 26: torch.compile across the sync patches, waits the shim skipped, the H2D
side's bookkeeping. Each test failed on the code before it (checked against a copy of that tree).

CPU stand-ins throughout: ``cc.install("on")`` on a CPU torch (the conftest pretends a GPU is there), a queue of
the shim's own (:class:`OrderedWorker`) whose covering wait "runs" a job by writing the host memory, recorders in
place of the waits that would need a GPU.
"""

from __future__ import annotations

import types

import pytest
import torch

import syncless.cc as cc
from syncless.cc import _bypass, _d2h, _host_writes, _routing, _shim, _staging, _streams
from syncless.cc._worker import D2HCopyError, OrderedWorker


@pytest.fixture
def installed():
    import torch._dynamo  # noqa: F401  (imported before install(), as docs/cc.md asks of compiled programs)

    cc.install("on")
    try:
        yield
    finally:
        cc.uninstall()
        torch._dynamo.reset()


# torch.compile ---------------------------------------------------------------------------------------------------


def test_an_event_made_in_c_is_still_a_torch_event_and_compiles_while_installed(installed):
    """``torch.Event`` is replaced by a subclass while installed; dynamo tells events apart by
    ``isinstance(value, torch.Event)``, so an event made in C (on CUDA builds every ``torch.cuda.Event`` too) became
    an unknown object and its methods broke a ``fullgraph=True`` region."""
    made_in_c = torch._C.Event("cpu")
    assert isinstance(made_in_c, torch.Event) and issubclass(torch._C.Event, torch.Event)
    assert isinstance(torch.Event("cpu"), torch._C.Event)  # the covering subclass's own events too
    for body in (lambda e: e.query(), lambda e: e.synchronize()):
        torch._dynamo.reset()

        def step(x, e, body=body):
            body(e)
            return x + 1

        assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2), made_in_c),
                           torch.full((2,), 2.0))


def test_a_device_synchronize_in_a_compiled_region_compiles_once_while_copies_come_and_go(installed, monkeypatch):
    """The patched ``torch.cuda.synchronize`` was traced: its reads of the covers and of the queue's count became
    guards, so each offloaded copy recompiled the frame (up to the limit, which ``fullgraph=True`` turns into an
    error), and a copy pending at trace time broke the graph on the queue's lock."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def step(x):
        torch.cuda.synchronize("cpu")  # plain torch: a no-op dynamo drops
        return x + 1

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    worker = OrderedWorker("review26-compile")
    try:
        for n in range(1, 11):
            worker._submitted = worker._completed = n  # the n-th offloaded copy has finished
            monkeypatch.setattr(_d2h, "_COVER", [((worker, n),)])
            assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
        assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
        torch._dynamo.reset()
        seq = worker.submit(lambda: None, "copy", eager=False)  # a copy in flight while the frame is traced
        monkeypatch.setattr(_d2h, "_COVER", [((worker, seq),)])
        monkeypatch.setattr(_d2h, "_PENDING", [1])
        assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))
        worker.wait_for(seq)
    finally:
        worker.shutdown(5.0)


def test_uninstall_gives_dynamos_handler_table_back_to_torchs_own_synchronize():
    """dynamo's table of specially handled callables (keyed by the function) built while installed was keyed by
    syncless's entry, and ``torch.cuda.synchronize`` lost its handling for the process, after ``uninstall()`` too."""
    import torch._dynamo
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    def step(x):
        torch.cuda.synchronize("cpu")
        return x + 1

    TorchInGraphFunctionVariable._get_handlers.cache_clear()
    cc.install("on")
    try:
        torch._dynamo.reset()
        assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        cc.uninstall()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.cuda.synchronize in TorchInGraphFunctionVariable._get_handlers()


# waits the shim skipped ---------------------------------------------------------------------------------------------


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on GPU 0 (no override of its own): stands in for a CUDA tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_a_blocking_read_under_a_dispatch_mode_still_waits_for_the_d2h_streams_copies(installed, monkeypatch):
    """Under a ``TorchDispatchMode`` the call never comes back through a wrapper, and the settle was gated on
    reading the call: ``item()`` on a D2H stream returned before the offloaded copy wrote the buffer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    settled = []
    monkeypatch.setattr(_shim, "_settle_d2h_stream", settled.append)
    monkeypatch.setattr(_d2h, "_PENDING", [1])
    x = torch.ones(1).as_subclass(_OnGpu)
    x.item()
    assert settled == [0]
    with PassThrough():
        x.item()
        x.tolist()
    assert settled == [0, 0, 0]


@pytest.fixture
def failed_copy_on_d(monkeypatch):
    """A D2H stream current on GPU 0 whose one offloaded copy has ended with a failure (nothing pending)."""
    stream = types.SimpleNamespace(cuda_stream=7, device=types.SimpleNamespace(index=0))
    record = _d2h._D2HStream(stream)
    monkeypatch.setitem(_d2h._streams_by_key, (0, 7), record)
    monkeypatch.setattr(_streams, "current_stream", lambda index: stream)

    def failing_copy():
        raise RuntimeError("the helper process is gone")

    failing_copy.settled = _d2h._settled
    with _d2h._offload_lock:
        seq = _d2h._submit_locked(record, failing_copy, False)
    record.worker.wait_for(seq, timeout_s=5)
    assert not _d2h.pending() and _d2h.busy()
    yield record
    record.worker.take_unreported()
    record.worker.shutdown(2)


@pytest.mark.parametrize("call", ["settle_d2h_stream", "bypass"])
def test_a_failed_copy_that_has_ended_is_raised_by_the_calls_on_its_stream(failed_copy_on_d, call):
    """docs/cc.md "Errors": ``cpu()``/``item()``/``tolist()``, copies on ``D`` and the bypassing copies raise a
    failed copy; once it had ended (nothing pending) they returned, and the program read the unwritten buffer."""
    settle = (lambda: _shim._settle_d2h_stream(0)) if call == "settle_d2h_stream" else _bypass.settle_current_d2h_streams
    with pytest.raises(D2HCopyError, match="helper process is gone"):
        settle()
    settle()  # this thread has had it: once


def test_asarray_waits_for_the_current_d2h_streams_copies(installed, monkeypatch):
    """``torch.asarray(h, device=...)`` copies in C++ as ``as_tensor`` does, and was not fronted."""
    waits = []
    monkeypatch.setattr(_bypass, "settle_current_d2h_streams", lambda: waits.append(1))
    h = torch.arange(4.0)
    torch.asarray(h)
    assert waits == []  # nothing pending: straight to torch
    monkeypatch.setattr(_d2h, "_PENDING", [1])
    assert torch.equal(torch.asarray(h, dtype=torch.float64), h.double())
    assert len(waits) == 1


def test_asarray_and_as_tensor_keep_the_default_device_while_installed_and_after():
    """torch's set of factories a default device applies to is keyed by the function: built while installed it held
    syncless's entries, and ``torch.asarray``/``torch.as_tensor`` under ``with torch.device(...)`` ignored it, for
    the process. It is built from torch's own functions before any entry is installed."""
    import torch.utils._device as device_module

    device_module._device_constructors.cache_clear()
    cc.install("on")
    try:
        with torch.device("meta"):
            assert torch.asarray([1.0, 2.0]).device.type == "meta"
            assert torch.as_tensor([1.0, 2.0]).device.type == "meta"
    finally:
        cc.uninstall()
    with torch.device("meta"):
        assert torch.asarray([1.0, 2.0]).device.type == "meta"


def test_a_subclass_of_the_covering_event_keeps_pythons_own_isinstance(installed):
    """Every subclass of the covering ``torch.Event`` inherited its metaclass and claimed every event (and every
    other subclass) as its own."""
    class Mine(torch.Event):
        pass

    class Other(torch.Event):
        pass

    made_in_c = torch._C.Event("cpu")
    assert isinstance(made_in_c, torch.Event) and not isinstance(made_in_c, Mine)
    assert isinstance(Mine("cpu"), Mine) and not isinstance(Other("cpu"), Mine) and not issubclass(Other, Mine)
    assert issubclass(Mine, torch.Event) and issubclass(Mine, torch._C.Event)


def test_an_event_made_in_a_compiled_region_compiles_while_installed_and_after():
    """dynamo's set of classes it builds in the graph held ``torch.Event`` by identity: built before ``install()``,
    ``torch.Event(...)`` in a ``fullgraph=True`` region failed while installed; built while installed, it failed
    after ``uninstall()``, for plain torch."""
    import torch._dynamo

    def step(x):
        torch.Event("cpu")
        return x + 1

    def compiles() -> bool:
        torch._dynamo.reset()
        return torch.equal(torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))

    assert compiles()  # plain torch, the table built with torch's own class
    cc.install("on")
    try:
        assert compiles()
    finally:
        cc.uninstall()
    assert compiles()


# the H2D side ------------------------------------------------------------------------------------------------------


class _Base:  # stands for torch.cuda.Event.__mro__[1]: torch's own query and wait
    def query(self):
        return True

    def wait(self, stream):
        pass


class _DeviceBoundEvent(_Base):
    """A CUDA event as torch has it: bound to the GPU it is first recorded on, refused on another's stream."""

    def __init__(self):
        self.device = None


def _record_on(event, stream):
    if event.device is None:
        event.device = stream.device_index
    if event.device != stream.device_index:
        raise RuntimeError(f"Event device {event.device} does not match recording stream's device "
                           f"{stream.device_index}.")


def test_a_recycled_note_event_is_recorded_only_on_its_own_gpu(monkeypatch):
    """The events of finished plain-D2H notes went back to one pool for every GPU: a readback on GPU 1 then
    recorded a GPU-0 event and raised, after torch's copy was enqueued."""
    monkeypatch.setattr(torch.cuda, "Event", _DeviceBoundEvent)
    monkeypatch.setattr(_streams, "record_event_raw", _record_on)
    gpu0, gpu1 = types.SimpleNamespace(device_index=0), types.SimpleNamespace(device_index=1)
    _host_writes.clear()
    try:
        h0, h1 = torch.zeros(16).share_memory_(), torch.zeros(16)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
        _host_writes.note_plain_d2h(h0, gpu0)
        _host_writes.order_after_pending_writes(None, h0)  # found done: its event is kept for the next note
        _host_writes.note_plain_d2h(h1, gpu1)  # raised here
        _host_writes.note_plain_d2h(torch.zeros(8), gpu0)  # GPU 0's spare goes to GPU 0
        assert sum(len(events) for events in _host_writes._spare_events.values()) == 0
    finally:
        _host_writes.clear()


@pytest.fixture
def offloaded_write(monkeypatch):
    """Host ``h`` (4 x 6) that offloaded job #5 is still writing; its covering wait runs it (writes the final bytes)."""
    _host_writes.clear()
    worker = OrderedWorker("review26-h2d")
    host = torch.zeros(4, 6)
    final = torch.arange(24.0).reshape(4, 6)
    waited = []

    def run_job(seq, **kwargs):
        host.copy_(final)
        worker._completed = seq
        waited.append(seq)

    monkeypatch.setattr(worker, "wait_for", run_job)
    worker._submitted = 5
    _host_writes.note_offloaded_d2h(host, (worker, 5))
    monkeypatch.setattr(_d2h, "_PENDING", [1])
    monkeypatch.setattr(_streams, "staging_stream", lambda index: "staging")
    yield host, final, waited
    _host_writes.clear()
    worker.shutdown(5.0)


@pytest.mark.parametrize("form", ["cast", "copy_into_another_layout"])
def test_a_staged_upload_torch_reads_at_the_call_waits_before_it_reads(offloaded_write, monkeypatch, form):
    """A source torch reads at the call (a transposed one cast, or copied into another layout) was cloned on the
    host before the wait for the offloaded copy writing it: the staged bytes were stale."""
    host, final, waited = offloaded_write

    def land(src, index, how="to", current=None):  # the real land()'s host-side steps, on the CPU
        _host_writes.order_after_pending_writes("staging", src)
        return src.clone()

    monkeypatch.setattr(_staging, "land", land)
    if form == "cast":
        assert torch.equal(_staging.land_converted(host.t(), 0, torch.float64, None), final.t().double())
    else:
        dst = torch.empty(6, 4)
        _staging.stage_into(dst, host.t(), None)
        assert torch.equal(dst, final.t())
    assert waited == [5]


@pytest.mark.parametrize("form", ["to", "cuda", "copy_", "too_large"])
def test_an_upload_left_to_torch_waits_for_the_offloaded_copy_writing_its_source(offloaded_write, monkeypatch, form):
    """Only staged and inlined uploads waited: a blocking ``h.to("cuda")``/``h.cuda()``/``y.copy_(h)``, or a
    ``non_blocking`` one too large to stage, read ``h`` before the offloaded copy wrote it."""
    host, final, waited = offloaded_write
    seen = []

    def torchs_copy(*args, **kwargs):  # torch's own copy: reads the host memory now
        seen.append((args[1] if form == "copy_" else args[0]).clone())
        return args[0]

    monkeypatch.setattr(_shim, "_present_cuda_index", lambda device: 0)
    monkeypatch.setattr(_shim, "_settle_d2h_stream", lambda index: None)  # no D2H stream is current
    monkeypatch.setattr(_shim, "_settle_for_cuda", lambda device: None)
    if form == "to":
        _shim._wrap_to(torchs_copy)(host, "cuda:0")
    elif form == "cuda":
        _shim._wrap_cuda(torchs_copy)(host)
    elif form == "copy_":
        dst = torch.empty(4, 6).as_subclass(_OnGpu)
        monkeypatch.setattr(_shim, "_plain_same_side", lambda a, b: False)
        _shim._wrap_copy(torchs_copy)(dst, host)
    else:
        monkeypatch.setattr(_shim._STATE, "max_staged_bytes", 8)  # the upload is left to torch as too large
        monkeypatch.setattr(_streams, "any_current_capture", lambda index: False)
        _shim._wrap_to(torchs_copy)(host, "cuda:0", non_blocking=True)
    assert waited == [5] and torch.equal(seen[0], final), f"torch's copy read {seen[0][0]}"


def test_an_upload_inside_a_forward_ad_level_is_torchs_own():
    """A staged upload's tangent was allocated on the staging stream and marked as used by no other: its memory
    could be handed out again while the current stream still read it. Inside a dual level it is torch's own."""
    facts = _routing.CopyFacts(src_type="cpu", dst_type="cuda", non_blocking=True, nbytes=64)
    assert _routing.route_copy(facts, 1 << 20) == (_routing.STAGE_FRESH, "")
    facts.dual_level = True
    assert _routing.route_copy(facts, 1 << 20) == (_routing.ORIGINAL, "autograd")
    facts.into_existing = facts.registered_target = True
    assert _routing.route_copy(facts, 1 << 20) == (_routing.ORIGINAL, "autograd")


# the emulator (the oracle "CC without the shim") --------------------------------------------------------------------


@pytest.fixture
def emulated_waits(monkeypatch):
    """``cc.emulate()`` over a layer that plays torch's copy (returns the tensor); the emulated waits, recorded."""
    from syncless._core import patching
    from syncless.cc import _emulation

    waits = []
    monkeypatch.setattr(_emulation, "_emulate_wait", lambda device: waits.append(str(device)))

    def beneath(next_fn):
        def to(self, *args, **kwargs):
            return self  # stands for torch's real H2D (this torch has no GPU)

        return to

    patching.add_layer(torch.Tensor, "to", "test.beneath", patching.RANK_CC_EMULATION - 1, beneath)
    handle = cc.emulate()
    try:
        yield waits
    finally:
        handle.stop()
        patching.remove_layer(torch.Tensor, "to", "test.beneath")


def test_the_emulator_waits_after_a_copy_under_a_dispatch_mode_or_functorch(emulated_waits):
    """The real copy under a ``TorchDispatchMode``, inside ``vmap`` or of a ``__torch_dispatch__`` tensor runs at the
    aten level and never comes back through ``Tensor.to``: the emulator took it for an override's call and made no
    wait, so the oracle under-waited."""
    from torch.testing._internal.two_tensor import TwoTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(4)
    x.to("cuda", non_blocking=True)
    assert len(emulated_waits) == 1
    with PassThrough():
        x.to("cuda", non_blocking=True)
    torch.func.vmap(lambda t: t.to("cuda", non_blocking=True))(torch.randn(3, 4))
    TwoTensor(torch.randn(4), torch.randn(4)).to("cuda", non_blocking=True)
    assert len(emulated_waits) == 4
    x.to("meta", non_blocking=True)  # moves no bytes across PCIe: no wait (it waited)
    assert len(emulated_waits) == 4


@pytest.mark.parametrize("setup", ["emulate", "install"])
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_the_emulator_skips_its_wait_only_for_another_threads_global_capture(monkeypatch, setup, mode):
    """With the emulator alone another thread's capture was not seen (its wait would invalidate a global-mode
    capture); with the shim every capture was skipped, where a thread_local or relaxed one allows the wait and CC's
    driver makes it."""
    import threading

    from syncless.cc import _emulation

    waits = []
    monkeypatch.setattr(_streams, "is_current_stream_capturing", lambda index: False)  # this thread's stream is not
    monkeypatch.setattr(_streams, "current_stream", lambda index: f"stream {index}")
    monkeypatch.setattr(_streams, "device_index", lambda device: 0)
    monkeypatch.setattr(_streams, "wait_stream_raw", waits.append)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin",
                        lambda self, pool=None, capture_error_mode="global": None, raising=False)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", lambda self: None, raising=False)
    handle = cc.emulate() if setup == "emulate" else None
    if handle is None:
        cc.install("emulate")
    try:
        graph = object()
        torch.cuda.CUDAGraph.capture_begin(graph, capture_error_mode=mode)  # another thread's capture, open
        other = threading.Thread(target=_emulation._emulate_wait, args=(torch.device("cuda", 0),))
        other.start()
        other.join()
        torch.cuda.CUDAGraph.capture_end(graph)
        assert len(waits) == (0 if mode == "global" else 1)
        _emulation._emulate_wait(torch.device("cuda", 0))  # the capture has ended
        assert len(waits) == (1 if mode == "global" else 2)
    finally:
        if handle is not None:
            handle.stop()
        else:
            cc.uninstall()


def test_an_emulation_handle_ends_only_the_emulation_it_started():
    """``uninstall()`` and a new ``install("emulate")`` inside a ``with cc.emulate():`` block: the handle's exit
    removed the new emulation, leaving the shim installed without it (benchmarks would then call plain copies
    emulated)."""
    with cc.emulate():
        cc.uninstall()
        cc.install("emulate")
    try:
        assert cc.is_emulating() and _shim.is_shim_installed()
    finally:
        cc.uninstall()
    assert not cc.is_emulating()
    with cc.emulate() as handle:
        assert cc.is_emulating()
    assert not cc.is_emulating() and handle.started


def test_the_wait_before_an_upload_left_to_torch_reads_no_event_and_skips_captures_and_wrappers(
        offloaded_write, monkeypatch):
    """Found in the review of this round's own change: the wait queried plain notes' events (not allowed while a
    graph captures, where the shim leaves uploads to torch), ran during this thread's capture, and read the storage
    address of a ``__torch_dispatch__`` wrapper (which raises). Another thread's capture does not stop it: while
    that thread's ``capture_begin`` drains the offloaded copies, this upload must wait for them too (found in the
    third review: skipping on any capture read memory a copy had not yet written)."""
    from torch.testing._internal.two_tensor import TwoTensor

    host, final, waited = offloaded_write

    def no_query(entry):
        raise AssertionError(f"queried {entry}")

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(_streams, "record_event_raw", lambda event, stream: None)
    monkeypatch.setattr(torch.cuda, "Event", _DeviceBoundEvent)
    _host_writes.note_plain_d2h(host, types.SimpleNamespace(device_index=0))  # a plain note over the same bytes
    monkeypatch.setattr(_host_writes, "_is_done", no_query)
    monkeypatch.setattr(_streams, "this_thread_captures", lambda: True)
    _shim._wait_for_writes_into(host)  # this thread's stream captures: torch's copy is a graph node
    assert waited == []
    monkeypatch.setattr(_streams, "this_thread_captures", lambda: False)
    _shim._wait_for_writes_into(TwoTensor(torch.zeros(2), torch.zeros(2)))  # a wrapper: no memory of its own
    assert waited == []
    monkeypatch.setattr(_streams, "CAPTURES", [1])  # another thread's capture_begin, still draining
    _shim._wait_for_writes_into(host)
    assert waited == [5] and torch.equal(host, final)


def test_the_registry_changes_only_under_its_lock_and_a_lookup_scans_a_copy():
    """A target that died in a collection run by the lookup's own snapshot popped from the dictionary being read
    (``dictionary changed size during iteration`` out of the user's ``copy_``); a weakref callback could also drop
    a newer registration at the same span. Dead references now vouch for nothing and go at the next registration."""
    import gc

    pool = torch.zeros(64, 4)
    kept = [pool[i] for i in range(0, 64, 2)]
    for row in kept:
        _staging._remember_target(row)
    for i in range(1, 64, 2):  # rows held only by a cycle: they die in a collection
        row = pool[i]
        row.cycle = row
        _staging._remember_target(row)
        del row
    gc.collect()
    assert _staging.live_targets() == len(kept)
    assert not _staging.is_registered_target(pool[1][1:])  # the scan: a dead row vouches for nothing
    assert _staging.is_registered_target(pool[2][1:])
    _staging._remember_target(pool[0])  # a registration drops the dead
    assert sum(len(spans) for spans in _staging._TARGETS.values()) == len(kept)
    del kept
    gc.collect()
    assert not _staging.live_targets()


def test_installing_or_removing_one_capture_noting_layer_keeps_the_others_captures(monkeypatch):
    """Installing the shim over the emulator forgot a capture the emulator had noted, still open (the emulator then
    waited during it); removing the emulator left a capture that ended unseen noted for good (no wait ever again)."""
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin",
                        lambda self, pool=None, capture_error_mode="global": None, raising=False)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", lambda self: None, raising=False)
    handle = cc.emulate()
    graph = object()
    try:
        torch.cuda.CUDAGraph.capture_begin(graph)
        assert _streams.GLOBAL_CAPTURES[0] == 1
        cc.install("on")  # the shim, over the emulator, while the capture is open
        assert _streams.GLOBAL_CAPTURES[0] == 1 and _streams.CAPTURES[0] == 1
        torch.cuda.CUDAGraph.capture_end(graph)
        assert _streams.CAPTURES[0] == 0
        torch.cuda.CUDAGraph.capture_begin(graph)
    finally:
        cc.uninstall()  # the shim and the emulator go; the capture never ends through a hook
        handle.stop()
    assert _streams.CAPTURES[0] == _streams.GLOBAL_CAPTURES[0] == 0

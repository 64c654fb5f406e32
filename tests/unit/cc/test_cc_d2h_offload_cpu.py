"""The D2H offload's ordering bookkeeping on a CPU-only torch (recording stand-ins for the CUDA calls).

What is under test is which stream each GPU-side mark goes on, and in what
order: the ready event on the D2H stream itself (so every ``wait_stream``
and ``wait_event`` it saw is covered, not one remembered producer), then the
gate for the job's number; the worker waits for the ready event, copies, and
releases the gate even when the copy fails. Issue 14's bugs (a) and (b) were
the ready event recorded on the last ``wait_stream`` producer.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

import syncless.cc as cc
from syncless._core.errors import SynclessError
from syncless.cc import _d2h, _streams
from syncless.cc._worker import D2HCopyError, OrderedWorker


class _Ready:
    """Stands in for a torch.cuda.Event (making a real one needs a GPU)."""

    count = 0

    def __init__(self):
        _Ready.count += 1
        self.name = f"R{_Ready.count}"


@pytest.fixture
def gpu_calls(monkeypatch):
    """Replace the thin CUDA helpers by recorders; return the shared log."""
    log: list[tuple] = []
    lock = threading.Lock()

    def note(*entry):
        with lock:
            log.append(entry)

    worker_stream = SimpleNamespace(name="W", device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "Event", _Ready)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(_streams, "worker_stream", lambda index: worker_stream)
    monkeypatch.setattr(_streams, "record_event_raw", lambda event, stream: note("record", event.name, stream.name))
    monkeypatch.setattr(_streams, "wait_flag_geq", lambda stream, addr, value: note("gate", stream.name, addr, value))
    monkeypatch.setattr(_streams, "wait_event_raw", lambda event: note("worker waits", event.name))
    monkeypatch.setattr(_streams, "write_flag", lambda stream, addr, value: note("flag", stream.name, addr, value))
    monkeypatch.setattr(_streams, "wait_stream_raw", lambda stream: note("worker drains", stream.name))
    worker = OrderedWorker("test-d2h")
    monkeypatch.setattr(_d2h, "WORKER", worker)
    yield log, worker
    worker.shutdown(5.0)


def _d2h_stream(name="D", address=0x1000):
    return _d2h._D2HStream(SimpleNamespace(name=name, device=torch.device("cuda", 0)), address)


def test_ready_event_goes_on_the_d2h_stream_then_the_gate(gpu_calls):
    log, worker = gpu_calls
    record = _d2h_stream()
    src, dst = torch.randn(32), torch.full((32,), float("nan"))
    # Whatever the caller did on D before (wait_stream(p1), wait_stream(p2), wait_event(e), a kernel on D), all of
    # it is in D's queue in front of the ready event: the worker waits for D, never for one producer.
    seq = _d2h.offload(record, dst, src, "copy")
    worker.wait_and_raise(seq, timeout_s=5.0)
    assert torch.equal(dst, src)
    ready = log[0][1]
    # The caller's thread and the worker's run concurrently: compare each thread's own calls in order.
    assert [e for e in log if e[0] in ("record", "gate")] == [
        ("record", ready, "D"),            # on the D2H stream itself
        ("gate", "D", 0x1000, seq),        # later work on D waits for the copy
    ]
    assert [e for e in log if e[0] not in ("record", "gate")] == [
        ("worker waits", ready),
        ("flag", "W", 0x1000, seq),        # after the copy, on the worker's stream
        ("worker drains", "W"),
    ]


def test_failed_copy_still_releases_its_gate_and_surfaces(gpu_calls):
    log, worker = gpu_calls
    record = _d2h_stream()
    seq = _d2h.offload(record, torch.empty(3), torch.randn(5), "bad copy")  # the worker's copy_ raises
    with pytest.raises(D2HCopyError, match="bad copy"):
        worker.wait_and_raise(seq, timeout_s=5.0)
    assert ("flag", "W", 0x1000, seq) in log  # D is never left waiting on a gate nobody opens


def test_records_and_gates_are_enqueued_in_job_order_across_threads(gpu_calls):
    log, worker = gpu_calls
    streams = [_d2h_stream(f"D{i}", 0x1000) for i in range(4)]

    def issue(record):
        for _ in range(25):
            _d2h.offload(record, torch.empty(4), torch.randn(4), "copy")

    threads = [threading.Thread(target=issue, args=(r,)) for r in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    worker.wait_and_raise(worker.submitted, timeout_s=30.0)
    host_marks = [e for e in log if e[0] in ("record", "gate")]
    assert len(host_marks) == 200
    # Every record is followed at once by its own gate, and the gates come in job-number order: no gate #m is
    # ever enqueued after a ready event #n > m (the no-deadlock argument of the module docstring).
    for i in range(0, 200, 2):
        assert host_marks[i][0] == "record" and host_marks[i + 1][0] == "gate"
        assert host_marks[i][2] == host_marks[i + 1][1]  # same stream
        assert host_marks[i + 1][3] == i // 2 + 1
    flags = [e[3] for e in log if e[0] == "flag"]
    assert flags == list(range(1, 101))


def test_new_d2h_stream_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SynclessError, match=r"needs a CUDA GPU.*is_available\(\) is False"):
        cc.new_d2h_stream()

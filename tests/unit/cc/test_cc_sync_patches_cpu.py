"""The patched event record on a CPU-only torch: recorded where the caller asked, stamped with the copies so far."""

import pytest
import torch

import syncless.cc as cc
from syncless.cc import _sync_patches
from syncless.cc._worker import OrderedWorker


@pytest.fixture(autouse=True)
def _clean():
    yield
    cc.uninstall()


def _worker_with_submitted(n):
    worker = OrderedWorker("test-marks")
    worker._submitted = n
    return worker


def _a_cuda_event():
    """A torch.cuda.Event that is never recorded (making one touches no GPU)."""
    try:
        return torch.cuda.Event()
    except RuntimeError:  # a CPU-only torch: its torch.cuda.Event is a placeholder that refuses to be made
        return object.__new__(torch.cuda.Event)


def test_event_record_goes_to_the_stream_asked_for_and_is_stamped(monkeypatch):
    recorded_on = []
    record = _sync_patches._wrap_event_record(lambda event, stream=None: recorded_on.append(stream))
    monkeypatch.setattr(_sync_patches, "WORKER", _worker_with_submitted(7))  # seven copies submitted so far
    d2h, other = object(), object()
    for stream in (d2h, other, None):
        event = _a_cuda_event()
        record(event, stream)
        assert getattr(event, _sync_patches._MARK) == 7
    assert recorded_on == [d2h, other, None]  # nothing redirected: torch's own semantics


def test_torch_event_subclass_records_where_asked(monkeypatch):
    seen = []

    class FakeTorchEvent:  # stands in for the C torch.Event, whose record needs a GPU
        def record(self, stream=None):
            seen.append(stream)

    event_type = _sync_patches._wrap_torch_event(FakeTorchEvent)
    monkeypatch.setattr(_sync_patches, "WORKER", _worker_with_submitted(3))
    event = event_type()
    marker = object()
    event.record(marker)
    assert seen == [marker]
    assert getattr(event, _sync_patches._MARK) == 3


def test_no_stream_method_is_patched_for_ordering():
    """wait_stream/record_event/wait_event stay torch's own: the D2H gate orders them on the GPU."""
    names = {(owner, name) for owner, name, _ in _sync_patches.patch_targets()}
    for name in ("wait_stream", "wait_event", "record_event"):
        assert (torch.cuda.Stream, name) not in names

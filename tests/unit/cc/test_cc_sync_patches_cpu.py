"""The patched ``Stream.record_event`` on a CPU-only torch: an event meant for a D2H stream is redirected once."""

from types import SimpleNamespace

import pytest
import torch

import syncless.cc as cc
from syncless._core import patching
from syncless.cc import _d2h, _streams, _sync_patches


def _a_cuda_event():
    """A torch.cuda.Event that is never recorded (making one touches no GPU)."""
    try:
        return torch.cuda.Event()
    except RuntimeError:  # a CPU-only torch: its torch.cuda.Event is a placeholder that refuses to be made
        return object.__new__(torch.cuda.Event)


@pytest.fixture
def d2h_stream(monkeypatch):
    """A registered D2H stream with a producer; plain objects stand in for the two CUDA streams."""
    d2h = SimpleNamespace(device=torch.device("cuda", 0), cuda_stream=0xD2, name="d2h")
    producer = SimpleNamespace(device=torch.device("cuda", 0), cuda_stream=0xF0, name="producer")
    monkeypatch.setitem(_d2h._streams_by_key, (0, d2h.cuda_stream), _d2h._D2HStream(d2h, producer))
    monkeypatch.setattr(_streams, "any_current_capture", lambda index: False)  # no GPU: nothing is captured
    monkeypatch.setattr(_streams, "is_capturing", lambda stream: False)
    yield d2h, producer
    cc.uninstall()


def test_record_event_redirects_each_event_once(d2h_stream, monkeypatch):
    d2h, producer = d2h_stream
    cc.install("on")  # torch.Event is now the covering subclass
    redirected = []
    real_redirect = _d2h.redirect_for_record

    def counting_redirect(stream):
        redirected.append(stream.name)
        return real_redirect(stream)

    monkeypatch.setattr(_d2h, "redirect_for_record", counting_redirect)
    recorded_on = []

    def torch_record_event(stream, event=None):  # stands in for torch's: ``event.record(stream)`` needs a GPU
        recorded_on.append(stream.name)
        return event

    record_event = _sync_patches._wrap_record_event(torch_record_event)
    covered_events = [
        None,                                   # torch makes a torch.cuda.Event; its patched record redirects
        _a_cuda_event(),                        # patched record redirects
        torch.Event(device="cpu"),              # the covering subclass: its record redirects
    ]
    for event in covered_events:
        record_event(d2h, event)
    plain = patching.original(torch, "Event")(device="cpu")  # a plain C torch.Event: its record cannot redirect
    record_event(d2h, plain)
    assert recorded_on == ["d2h", "d2h", "d2h", "producer"]
    assert redirected == ["d2h"]


def test_record_event_leaves_other_streams_alone(d2h_stream):
    _, producer = d2h_stream
    plain = torch.Event(device="cpu")  # not installed: the plain C type
    seen = []
    record_event = _sync_patches._wrap_record_event(lambda stream, event=None: seen.append(stream) or event)
    assert record_event(producer, plain) is plain
    assert seen == [producer]

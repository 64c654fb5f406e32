"""``_streams.current_stream``: torch's current stream from a cache of stream objects (CPU only, torch faked)."""

import types

import pytest
import torch

from syncless.cc import _streams


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA build's entry points, faked: the current stream of each device, and stream objects that say what made them."""
    current = {0: (3, 0, 1), 1: (7, 1, 1)}
    made = []

    def make_stream(stream_id, device_index, device_type):
        made.append((stream_id, device_index, device_type))
        return types.SimpleNamespace(stream_id=stream_id, device_index=device_index, device_type=device_type)

    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: current[index], raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", make_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: pytest.fail("torch's own function was called"))
    monkeypatch.setattr(_streams, "_stream_objects", {})
    monkeypatch.setattr(_streams, "_CUDA_UP", [False])  # "seen initialized" is asked of torch again
    return types.SimpleNamespace(current=current, made=made)


def test_the_same_stream_gives_the_same_object_and_another_stream_a_new_one(fake_cuda):
    first = _streams.current_stream(0)
    assert (first.stream_id, first.device_index, first.device_type) == (3, 0, 1)
    assert _streams.current_stream(0) is first
    other_device = _streams.current_stream(1)
    assert other_device is not first and other_device.stream_id == 7
    fake_cuda.current[0] = (5, 0, 1)  # the program switched streams on GPU 0
    switched = _streams.current_stream(0)
    assert switched.stream_id == 5 and switched is not first
    fake_cuda.current[0] = (3, 0, 1)  # and back: the first object again, nothing new made
    assert _streams.current_stream(0) is first
    assert fake_cuda.made == [(3, 0, 1), (7, 1, 1), (5, 0, 1)]


def test_the_cache_starts_over_when_full(fake_cuda, monkeypatch):
    monkeypatch.setattr(_streams, "_STREAM_OBJECTS_MAX", 4)
    for stream_id in range(10):
        fake_cuda.current[0] = (stream_id, 0, 1)
        assert _streams.current_stream(0).stream_id == stream_id
        assert len(_streams._stream_objects) <= 4
    assert _streams.current_stream(0) is _streams.current_stream(0)


@pytest.mark.parametrize("why", ["no C entry point", "CUDA not initialized yet"])
def test_torchs_own_function_answers_where_the_cache_cannot(fake_cuda, monkeypatch, why):
    if why == "no C entry point":
        monkeypatch.delattr(torch._C, "_cuda_getCurrentStream")
    else:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # torch's function initializes CUDA itself
    sentinel = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: sentinel)
    assert _streams.current_stream(0) is sentinel
    assert not fake_cuda.made

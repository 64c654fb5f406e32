"""``_staging.land``: the staged H2D's steps, in order, with the CUDA parts faked (CPU only)."""

import types

import pytest
import torch

from syncless.cc import _emulation, _host_writes, _staging, _streams


@pytest.fixture
def steps(monkeypatch):
    """Fake the streams and torch's own methods; return the list of steps land takes."""
    taken = []
    current, staging = types.SimpleNamespace(name="current"), types.SimpleNamespace(name="staging", device="cuda:0")

    class OnStream:
        def __init__(self, stream, previous):
            self.stream, self.previous = stream, previous

        def __enter__(self):
            taken.append(("switch to", self.stream.name))

        def __exit__(self, *exc):
            taken.append(("switch back to", self.previous.name))

    class Landed:
        def record_stream(self, stream):
            taken.append(("record_stream", stream.name))

    def torch_own(name):
        def method(*args, **kwargs):
            taken.append((f"torch's own {name}", kwargs))
            return Landed()
        return method

    monkeypatch.setattr(_streams, "current_stream", lambda index: current)
    monkeypatch.setattr(_streams, "staging_stream", lambda index: staging)
    monkeypatch.setattr(_streams, "OnStream", OnStream)
    monkeypatch.setattr(_streams, "order_after", lambda waiter, producer: taken.append(
        ("order", waiter.name, "after", producer.name)))
    monkeypatch.setattr(_streams, "wait_stream_raw", lambda stream: taken.append(("host waits for", stream.name)))
    monkeypatch.setattr(_host_writes, "order_after_pending_writes", lambda stream, src: taken.append(
        ("after pending host writes", stream.name)))
    monkeypatch.setattr(_staging, "_torch_own", torch_own)
    return taken


@pytest.mark.parametrize("emulated", [False, True])
@pytest.mark.parametrize("how", ["to", "cuda"])
def test_land_copies_on_staging_then_hands_the_result_to_the_current_stream(steps, monkeypatch, emulated, how):
    monkeypatch.setattr(_emulation, "_installed", emulated)
    _staging.land(object(), 0, how=how)
    copy = ("torch's own to", {"device": torch.device("cuda", 0), "non_blocking": True}) if how == "to" else (
        "torch's own cuda", {"non_blocking": True})
    expected = [("after pending host writes", "staging"), ("switch to", "staging"), copy,
                ("switch back to", "current")]
    if emulated:  # emulated CC: the host waits for the staging stream, as the driver would after the copy
        expected.append(("host waits for", "staging"))
    expected += [("order", "current", "after", "staging"), ("record_stream", "current")]
    assert steps == expected


def test_the_emulated_wait_is_counted(steps, monkeypatch):
    from syncless.cc._stats import COUNTERS

    monkeypatch.setattr(_emulation, "_installed", True)
    before = COUNTERS.snapshot().emulated_waits
    _emulation.wait_after_copy_on(types.SimpleNamespace(name="staging"))
    assert COUNTERS.snapshot().emulated_waits == before + 1
    monkeypatch.setattr(_emulation, "_installed", False)
    _emulation.wait_after_copy_on(types.SimpleNamespace(name="staging"))
    assert COUNTERS.snapshot().emulated_waits == before + 1
    assert steps == [("host waits for", "staging")]


def test_land_refuses_a_method_it_does_not_know(steps):
    with pytest.raises(ValueError, match="how='copy_'"):
        _staging.land(object(), 0, how="copy_")
    assert steps == []

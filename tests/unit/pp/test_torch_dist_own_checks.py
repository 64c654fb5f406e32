"""The torch.distributed transport's own checks, in one process over a stand-in wire (CPU, no peer).

The wire stands in for the other stage only: it hands out the metadata and
data a peer would have sent and records what the transport posted. The
transport's decisions (step order, row bounds, failing for good, which group
carries gloo traffic) run as they do between real ranks.
"""

from __future__ import annotations

import threading
import types
from collections import deque

import pytest
import torch
import torch.distributed as dist

from syncless._core.errors import PeerTimeoutError, TransportClosedError, TransportFailedError
from syncless.pp import _torch_dist
from syncless.pp._group import StageMap
from syncless.pp._layout import TensorSpec
from syncless.pp._torch_dist import TorchDistTransport, backend_for

CALLERS_GROUP = object()
SIDE_GROUP = object()
MAX_ROWS = 4
ROW = (3,)
TIMEOUT_S = 5.25  # an unusual value, easy to spot in messages


class _Work:
    def __init__(self, wire):
        self._wire = wire

    def wait(self, timeout=None):
        if self._wire.fail_waits:
            raise RuntimeError("[fake gloo] connection closed by peer")
        return True

    def is_completed(self):
        return True


class Wire:
    """The peer's side: queued metadata (or errors) and data; records every posted operation."""

    def __init__(self):
        self.metas = deque()
        self.data = deque()
        self.posted = []
        self.meta_calls = 0
        self.fail_waits = False

    def recv_meta(self, side_group, src, tag, length, timeout_s, what):
        self.meta_calls += 1
        item = self.metas.popleft()
        if isinstance(item, BaseException):
            raise item
        return torch.tensor(item, dtype=torch.int64)

    def isend(self, tensor, dst=None, group=None, tag=0):
        self.posted.append(("send", group, tag, tensor.clone()))
        return _Work(self)

    def irecv(self, tensor, src=None, group=None, tag=0):
        self.posted.append(("recv", group, tag, tensor))
        tensor.copy_(self.data.popleft())
        return _Work(self)

    def batch_isend_irecv(self, ops):
        return [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]


@pytest.fixture
def wire(monkeypatch):
    fake = Wire()
    monkeypatch.setattr(_torch_dist, "recv_meta", fake.recv_meta)
    monkeypatch.setattr(dist, "isend", fake.isend)
    monkeypatch.setattr(dist, "irecv", fake.irecv)
    monkeypatch.setattr(dist, "batch_isend_irecv", fake.batch_isend_irecv)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group, tag: types.SimpleNamespace(
        op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    return fake


def _spec():
    return {"x": TensorSpec(torch.float32, ROW, MAX_ROWS)}


def _receiver():
    persistent = {"x": torch.full((MAX_ROWS, *ROW), float("nan"))}
    return TorchDistTransport(
        group=CALLERS_GROUP, side_group=SIDE_GROUP, stages=StageMap((0, 1), 1), tag=1000, recv_specs=_spec(),
        send_specs=None, persistent=persistent, device=torch.device("cpu"), timeout_s=TIMEOUT_S,
        fallback_reason=None,
    )


def _sender():
    return TorchDistTransport(
        group=CALLERS_GROUP, side_group=SIDE_GROUP, stages=StageMap((0, 1), 0), tag=1000, recv_specs={},
        send_specs=_spec(), persistent={}, device=torch.device("cpu"), timeout_s=TIMEOUT_S, fallback_reason=None,
    )


def test_a_step_out_of_order_is_a_protocol_error_and_the_transport_stays_failed(wire):
    receiver = _receiver()
    rows = torch.randn(3, *ROW)
    wire.metas.extend([[1, 3], [3, 2]])  # step 2 never came: the peer's counter is off
    wire.data.append(rows)
    assert torch.equal(receiver.recv()["x"], rows)
    posted = len(wire.posted)
    with pytest.raises(RuntimeError, match="protocol error") as first:
        receiver.recv()
    assert len(wire.posted) == posted  # no data receive was posted for the bad step
    with pytest.raises(RuntimeError) as again:
        receiver.recv()
    assert again.value is first.value and wire.meta_calls == 2


@pytest.mark.parametrize("rows", [MAX_ROWS + 1, -2])  # -1 (ABSENT) means "not sent"
def test_a_row_count_outside_the_region_is_a_protocol_error(wire, rows):
    receiver = _receiver()
    wire.metas.append([1, rows])
    with pytest.raises(RuntimeError, match="protocol error"):
        receiver.recv()
    assert wire.posted == []


def test_a_metadata_timeout_fails_the_transport_for_good(wire):
    receiver = _receiver()
    wire.metas.extend([PeerTimeoutError("stage 0 sent nothing"), [1, 0]])
    with pytest.raises(PeerTimeoutError) as first:
        receiver.recv()
    with pytest.raises(PeerTimeoutError) as again:
        receiver.recv()  # the step that would now arrive is not read: the stream of steps is broken
    assert again.value is first.value and wire.meta_calls == 1


def test_a_closed_transport_refuses_send_and_recv_and_posts_nothing(wire):
    sender, receiver = _sender(), _receiver()
    sender.close()
    receiver.close()
    with pytest.raises(RuntimeError, match="closed"):
        sender.send({"x": torch.randn(2, *ROW)})
    with pytest.raises(RuntimeError, match="closed"):
        receiver.recv()
    assert wire.posted == [] and wire.meta_calls == 0


def test_the_first_stage_cannot_receive_and_the_last_cannot_send(wire):
    first, last = _sender(), _receiver()
    with pytest.raises(RuntimeError, match="first stage"):
        first.recv()
    with pytest.raises(RuntimeError, match="last stage"):
        last.send({"x": torch.randn(1, *ROW)})
    assert wire.posted == [] and wire.meta_calls == 0


def test_gloo_traffic_never_uses_the_callers_group(wire):
    sender, receiver = _sender(), _receiver()
    step = torch.randn(2, *ROW)
    sender.send({"x": step})
    wire.metas.append([1, 2])
    wire.data.append(step)
    assert torch.equal(receiver.recv()["x"], step)
    kinds = sorted(kind for kind, *_ in wire.posted)
    assert kinds == ["recv", "send", "send"]  # metadata and data sent, data received
    assert all(group is SIDE_GROUP for _, group, _, _ in wire.posted)


def test_a_failed_data_receive_raises_peer_timeout_and_poisons_the_transport(wire, monkeypatch):
    receiver = _receiver()
    wire.metas.append([1, 2])
    wire.data.append(torch.randn(2, *ROW))
    wire.fail_waits = True
    with pytest.raises(PeerTimeoutError, match="did not arrive") as first:
        receiver.recv()
    assert receiver.error is first.value
    with pytest.raises(PeerTimeoutError) as again:
        receiver.recv()
    assert again.value is first.value


@pytest.mark.parametrize(
    "name, device_type, expected",
    [("nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo, cuda:nccl", "cpu", "gloo")],
)
def test_backend_for_picks_the_backend_of_the_device_type(monkeypatch, name, device_type, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group: name)
    assert backend_for(CALLERS_GROUP, device_type) == expected


class _CloneFails(torch.Tensor):
    """A tensor whose clone fails the way an out-of-memory error does (or an interrupt during it)."""

    error: BaseException = RuntimeError("CUDA out of memory (stand-in)")

    def clone(self, *args, **kwargs):
        raise type(self).error


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory (stand-in)"), KeyboardInterrupt()])
def test_a_failed_clone_posts_nothing_and_uses_no_step_number(wire, error):
    sender = _sender()
    bad = torch.randn(2, *ROW).as_subclass(_CloneFails)
    _CloneFails.error = error
    with pytest.raises(type(error)):
        sender.send({"x": bad})
    assert wire.posted == []  # no metadata went out for data that never existed
    assert sender.error is None
    good = torch.randn(3, *ROW)
    sender.send({"x": good})
    meta = [t for kind, _, tag, t in wire.posted if kind == "send" and tag == 1000]
    assert [m.tolist() for m in meta] == [[1, 3]]  # the failed attempt did not use step 1


def test_a_step_stopped_after_its_metadata_poisons_the_transport(wire, monkeypatch):
    sender = _sender()
    calls = []

    def isend(tensor, dst=None, group=None, tag=0):
        calls.append(tag)
        if tag == 1001:  # the data, right after the metadata
            raise KeyboardInterrupt
        return wire.isend(tensor, dst=dst, group=group, tag=tag)

    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(sender, "_batch", False)
    with pytest.raises(TransportFailedError, match="sending step 1: stopped while posting it") as first:
        sender.send({"x": torch.randn(2, *ROW)})
    assert calls == [1000, 1001] and sender.error is first.value
    with pytest.raises(TransportFailedError) as again:
        sender.send({"x": torch.randn(2, *ROW)})
    assert again.value is first.value and calls == [1000, 1001]


def test_abort_is_local_and_every_later_call_raises(wire):
    sender, receiver = _sender(), _receiver()
    assert sender.abort() == 0 and receiver.abort() == 0
    with pytest.raises(TransportFailedError, match="aborted"):
        sender.send({"x": torch.randn(1, *ROW)})
    with pytest.raises(TransportFailedError, match="aborted"):
        receiver.recv()
    assert wire.posted == [] and wire.meta_calls == 0
    sender.close()  # after abort, close() is harmless


def test_close_refuses_later_calls_with_the_closed_error(wire):
    sender = _sender()
    sender.close()
    assert sender.error is None
    with pytest.raises(TransportClosedError):
        sender.send({"x": torch.randn(1, *ROW)})


def test_abort_while_close_waits_for_a_send_lets_close_end_cleanly(wire, monkeypatch):
    # abort() is documented as safe from a signal handler or another thread while close() runs. Before,
    # abort() replaced the list of pending sends while close() waited on its head, and close() then
    # popped from the new, empty list: IndexError instead of a clean end.
    sender = _sender()
    sender.send({"x": torch.randn(2, *ROW)})
    waits = []

    class AbortingWork:
        def wait(self, timeout=None):
            waits.append(timeout)
            sender.abort()  # as a SIGINT handler would, in the middle of close()'s wait
            return True

        def is_completed(self):
            return False

    sender._pending[0] = ([AbortingWork()], sender._pending[0][1])
    sender.close()
    assert len(waits) == 1 and not sender._pending
    with pytest.raises(TransportFailedError, match="aborted"):
        sender.send({"x": torch.randn(1, *ROW)})


class _GlooWait:
    """A metadata wait that, as gloo's, only a broken connection or the timeout ends (``break_side_group``)."""

    def __init__(self):
        self.entered, self.broken = threading.Event(), threading.Event()

    def recv_meta(self, side_group, src, tag, length, timeout_s, what):
        self.entered.set()
        if self.broken.wait(timeout_s):
            raise PeerTimeoutError(f"{what}: rank {src}'s connection broke: Application timeout caused pair closure")
        raise PeerTimeoutError(f"{what}: rank {src} sent nothing within {timeout_s:g} s")

    def break_side_group(self, side_group, peer, what):
        self.broken.set()


@pytest.mark.parametrize("stop", ["abort", "close"])
def test_abort_or_close_on_another_thread_ends_a_recv_waiting_for_metadata_with_its_own_error(
        wire, monkeypatch, stop):
    gloo = _GlooWait()
    monkeypatch.setattr(_torch_dist, "recv_meta", gloo.recv_meta)
    monkeypatch.setattr(_torch_dist, "break_side_group", gloo.break_side_group, raising=False)
    receiver = _receiver()
    outcome = []

    def receive():
        try:
            receiver.recv()
        except TransportFailedError as err:  # TransportClosedError is one too
            outcome.append(err)
        except PeerTimeoutError as err:
            outcome.append(err)

    thread = threading.Thread(target=receive)
    thread.start()
    assert gloo.entered.wait(TIMEOUT_S)
    getattr(receiver, stop)()
    thread.join(TIMEOUT_S + 5)
    assert not thread.is_alive() and len(outcome) == 1
    if stop == "abort":
        assert type(outcome[0]) is TransportFailedError and "aborted" in str(outcome[0])
        assert outcome[0] is receiver.error
    else:
        assert type(outcome[0]) is TransportClosedError and "closed while the host waited" in str(outcome[0])
        assert receiver.error is None


@pytest.mark.parametrize("wait", [SIDE_GROUP, None, 1, "no"])
def test_recv_takes_only_a_bool_and_names_the_seeds_recv_pp_group(wire, wait):
    receiver = _receiver()
    wire.metas.append([1, 1])
    wire.data.append(torch.randn(1, *ROW))
    with pytest.raises(TypeError, match=r"recv\(wait=\.\.\.\) takes a bool; got .*recv\(pp_group\)"):
        receiver.recv(wait)
    assert wire.meta_calls == 0 and receiver.error is None
    assert receiver.recv(wait=True)["x"].shape == (1, *ROW)  # nothing was consumed

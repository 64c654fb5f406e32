"""What ``CopyEngineTransport.send()`` enqueues, on which stream, in which order (CPU only).

The driver calls go to a recording stand-in for ``_driver.Hot``; the
transport is assembled without set-up (no GPU), with CPU tensors as the
step. The GPU suites check the same orderings with real data; these tests
pin down the order the module docstring argues for, call by call.
"""

from __future__ import annotations

import pytest
import torch

from syncless.pp import _copy_engine as ce
from syncless.pp._layout import TensorSpec

RELAY, CALLER, OTHER, LEGACY = 900, 7, 8, 0
EMPTY, NEXT_FULL = 0x1008, 0x2000


class Named:
    """A stand-in event with a readable name."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


class RecordingHot:
    """Records every driver call as a tuple; ``fail_on`` makes that call raise."""

    def __init__(self, fail_on=None):
        self.calls = []
        self.fail_on = fail_on

    def _log(self, *call):
        self.calls.append(call)
        if call[0] == self.fail_on:
            raise RuntimeError(f"injected failure in {call[0]}")

    def record(self, event, stream):
        self._log("record", event.name, stream)

    def wait_event(self, event, stream):
        self._log("wait_event", event.name, stream)

    def wait_geq(self, stream, addr, value):
        self._log("wait_geq", stream, addr, value)

    def write(self, stream, addr, value):
        self._log("write", stream, addr, value)

    def memcpy_all(self, copies, stream):
        self._log("memcpy_all", stream, len(copies))


class Parts:
    def __init__(self):
        self.relay_stream = RELAY
        self.sent = Named("sent")
        self.next_targets = [0x5000, 0x6000]
        self.handed_out = 0
        self.sent_meta = []
        self.meta_out = self

    def acquire_event(self):
        self.handed_out += 1
        return Named(f"e{self.handed_out}")

    def send(self, step, rows):  # the metadata channel
        self.sent_meta.append((step, list(rows)))


class Binding:
    def enter(self):
        return False

    def exit(self, pushed):
        pass


class Watchdog:
    def __init__(self):
        self.brackets = []

    def watch(self, bracket):
        self.brackets.append(bracket)


class Stages:
    def name(self, index=None):
        return "stage 0 (rank 0)"


class Rows:
    def rows(self, tensors):
        return [tensors["hidden"].shape[0], tensors["ids"].shape[0]]


def _transport(depth, hot):
    transport = object.__new__(ce.CopyEngineTransport)
    specs = {"hidden": TensorSpec(torch.float32, (4,), 8), "ids": TensorSpec(torch.int64, (), 8)}
    transport.__dict__.update(
        _closed=False, _failure=None, _send_layout=object(), _send_check=Rows(), _send_step=0, depth=depth,
        _send_row_nbytes=[spec.row_nbytes for spec in specs.values()], _send_names=list(specs),
        _next_slots=[0x10000 * (k + 1) for k in range(depth)], _parts=Parts(), _hot=hot, _binding=Binding(),
        _index=0, _empty=EMPTY, _next_full=NEXT_FULL, _last_send_stream=None, _watchdog=Watchdog(),
        _send_what="send step {} to stage 1", _stages=Stages(),
    )
    return transport


def _step(rows=3):
    return {"hidden": torch.randn(rows, 4), "ids": torch.arange(rows)}


@pytest.fixture
def caller_stream(monkeypatch):
    current = {"stream": CALLER}
    monkeypatch.setattr(ce, "_current_stream", lambda index: current["stream"])
    return current


def test_depth_2_runs_on_the_relay_with_the_flag_wait_before_the_callers_work(caller_stream):
    hot = RecordingHot()
    transport = _transport(2, hot)
    for _ in range(3):
        transport.send(_step())
    third = hot.calls[-9:]
    assert third == [
        ("record", "e9", RELAY),  # pre
        ("wait_geq", RELAY, EMPTY, 1),  # the receiver is done with step 1's slot ...
        ("record", "e12", RELAY),  # waited
        ("record", "e11", CALLER),  # ready: after the caller's work before send()
        ("wait_event", "e11", RELAY),  # ... and only then the caller's work
        ("memcpy_all", RELAY, 2),
        ("write", RELAY, NEXT_FULL, 3),
        ("record", "e10", RELAY),  # post
        ("wait_event", "e10", CALLER),  # the caller's later work comes after the whole step
    ]
    # The first two steps have a free slot: no flag wait at all.
    assert [call for call in hot.calls if call[0] == "wait_geq"] == [("wait_geq", RELAY, EMPTY, 1)]
    # The caller's stream only ever records `ready` and waits for `post`.
    assert {call[0] for call in hot.calls if call[-1] == CALLER} == {"record", "wait_event"}
    bracket = transport._watchdog.brackets[-1]
    assert (bracket.stream, bracket.pre.name, bracket.ready.name, bracket.waited.name, bracket.post.name, bracket.step) \
        == (RELAY, "e9", "e11", "e12", "e10", 3)  # fmt: skip
    assert transport._parts.sent_meta == [(1, [3, 3]), (2, [3, 3]), (3, [3, 3])]


def test_depth_2_from_any_caller_stream_keeps_one_relay_and_needs_no_sent_event(caller_stream):
    hot = RecordingHot()
    transport = _transport(2, hot)
    for stream in (LEGACY, CALLER, OTHER, LEGACY):
        caller_stream["stream"] = stream
        transport.send(_step())
        assert hot.calls[-6] == ("record", hot.calls[-6][1], stream)  # this call's `ready` on its stream
        assert hot.calls[-1] == ("wait_event", hot.calls[-1][1], stream)  # and its wait for `post`
    assert all(call[1] != "sent" for call in hot.calls)
    assert {call[1] for call in hot.calls if call[0] in ("memcpy_all", "write")} == {RELAY}


def test_depth_0_runs_on_the_callers_stream_and_orders_a_change_of_stream(caller_stream):
    hot = RecordingHot()
    transport = _transport(0, hot)
    caller_stream["stream"] = LEGACY
    transport.send(_step())
    assert hot.calls == [
        ("record", "e1", LEGACY),
        ("wait_geq", LEGACY, EMPTY, 1),  # the receiver's stream reached recv(1)
        ("memcpy_all", LEGACY, 2),
        ("write", LEGACY, NEXT_FULL, 1),
        ("record", "sent", LEGACY),
        ("record", "e2", LEGACY),
    ]
    hot.calls.clear()
    caller_stream["stream"] = OTHER
    transport.send(_step())
    assert hot.calls[0] == ("wait_event", "sent", OTHER)  # step 2 goes out after step 1's `full` write
    assert all(call[-1] == OTHER or call[1] == OTHER for call in hot.calls)
    bracket = transport._watchdog.brackets[-1]
    assert (bracket.ready, bracket.waited) == (None, None)


def test_a_step_without_rows_still_raises_the_flag(caller_stream):
    hot = RecordingHot()
    transport = _transport(2, hot)
    transport.send(_step(rows=0))
    assert ("memcpy_all", RELAY, 0) in hot.calls and ("write", RELAY, NEXT_FULL, 1) in hot.calls


def test_a_failure_after_the_flag_wait_watches_it_and_fences_the_callers_stream(caller_stream):
    hot = RecordingHot(fail_on="memcpy_all")
    transport = _transport(2, hot)
    transport._send_step = 4  # step 5: a flag wait is enqueued before the copies fail
    with pytest.raises(RuntimeError, match="injected failure"):
        transport.send(_step())
    assert "part of the step was enqueued" in str(transport._failure)
    tail = hot.calls[hot.calls.index(("memcpy_all", RELAY, 2)) + 1:]
    assert tail == [
        ("record", "e2", RELAY),  # post, so the watchdog can release the flag wait if the peer never comes
        ("wait_event", "e2", CALLER),  # the caller's stream does not run ahead of the relay
    ]
    [bracket] = transport._watchdog.brackets
    assert (bracket.pre.name, bracket.post.name, bracket.ready, bracket.step) == ("e1", "e2", None, 5)
    assert transport._parts.sent_meta == []  # no metadata for a step that did not go out
    with pytest.raises(RuntimeError, match="part of the step was enqueued"):
        transport.send(_step())  # unusable from now on


def test_a_failure_before_anything_is_enqueued_watches_nothing(caller_stream):
    hot = RecordingHot(fail_on="record")
    transport = _transport(2, hot)
    with pytest.raises(RuntimeError, match="injected failure"):
        transport.send(_step())
    assert transport._watchdog.brackets == []

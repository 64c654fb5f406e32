"""The transport's own ``depth="auto"`` send() and recv(), end to end on the CPU, with only the GPU simulated.

Two ``CopyEngineTransport`` objects are assembled without set-up (no GPU): their buffers, slots and
persistent tensors are CPU tensors, their metadata channel is a real authenticated socket pair
(``_meta_channel``, the posted messages included), and their driver calls go to a simulated GPU that
executes them on the tensors' real addresses: each stream a queue, a copy 64 bytes at a time, flag
and event waits honoured, streams picked at random by a thread of its own. Each stage's host is a
thread calling the public ``send()``/``recv()``, so hosts and GPU interleave as they like.

What ``test_auto_protocol_cpu`` checks of the protocol alone is checked here through the transport:
the path bit in the metadata, the posted messages, the streams, and the data a reader sees after
every step.
"""

from __future__ import annotations

import collections
import ctypes
import random
import threading
import time

import pytest
import torch

from syncless.pp import _copy_engine as ce
from syncless.pp import _meta_channel as meta_channel
from syncless.pp._auto import AutoSender
from syncless.pp._layout import Layout, Ring, StepCheck, specs_from_persistent

pytestmark = pytest.mark.timeout(120)

MAX_ROWS = 6
SLOTS = 2


class Deadlock(AssertionError):
    pass


class Event:
    pass


class SimGPU:
    """Every stream of both stages as a queue of operations on real host addresses; one thread runs them."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.lock = threading.Lock()
        self.queues: dict[int, collections.deque] = {}
        self.recorded: collections.Counter = collections.Counter()
        self.reached: collections.Counter = collections.Counter()
        self.executed = 0

    def stream(self) -> int:
        with self.lock:
            sid = len(self.queues) + 1
            self.queues[sid] = collections.deque()
            return sid

    def enqueue(self, stream: int, *op) -> None:
        with self.lock:
            self.queues[stream].append(op)

    def _runnable(self, op: tuple) -> bool:
        if op[0] == "wait":
            return ctypes.c_uint64.from_address(op[1]).value >= op[2]
        if op[0] == "wait_event":
            return self.reached[op[1]] >= op[2]
        return True

    def step(self) -> bool:
        """Run one operation of a random runnable stream; return False when none can run."""
        with self.lock:
            ready = [sid for sid, queue in self.queues.items() if queue and self._runnable(queue[0])]
            if not ready:
                return False
            sid = self.rng.choice(ready)
            op = self.queues[sid].popleft()
            kind = op[0]
            if kind == "copy":
                _, dst, src, nbytes = op
                piece = min(nbytes, 64)
                ctypes.memmove(dst, src, piece)
                if piece < nbytes:
                    self.queues[sid].appendleft(("copy", dst + piece, src + piece, nbytes - piece))
            elif kind == "batch":
                copies = list(op[1])
                self.rng.shuffle(copies)
                for dst, src, nbytes in reversed(copies):
                    self.queues[sid].appendleft(("copy", dst, src, nbytes))
            elif kind == "write":
                ctypes.c_uint64.from_address(op[1]).value = op[2]
            elif kind == "record":
                self.reached[op[1]] = max(self.reached[op[1]], op[2])
            elif kind == "call":
                op[1]()
            self.executed += 1
            return True

    def busy(self) -> bool:
        with self.lock:
            return any(self.queues.values())


class SimHot:
    def __init__(self, gpu: SimGPU):
        self.gpu = gpu

    def memcpy(self, dst, src, nbytes, stream):
        self.gpu.enqueue(stream, "copy", dst, src, nbytes)

    def memcpy_all(self, copies, stream):
        self.gpu.enqueue(stream, "batch", list(copies))

    def wait_geq(self, stream, addr, value):
        self.gpu.enqueue(stream, "wait", addr, value)

    def write(self, stream, addr, value):
        self.gpu.enqueue(stream, "write", addr, value)

    def record(self, event, stream):
        with self.gpu.lock:
            self.gpu.recorded[event] += 1
            self.gpu.queues[stream].append(("record", event, self.gpu.recorded[event]))

    def wait_event(self, event, stream):
        with self.gpu.lock:
            self.gpu.queues[stream].append(("wait_event", event, self.gpu.recorded[event]))


_current = threading.local()


@pytest.fixture(autouse=True)
def simulated_streams(monkeypatch):
    """torch's current stream, per host thread, as the simulation's stream ids."""
    monkeypatch.setattr(ce, "_current_stream", lambda index: _current.stream)


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
    def __init__(self, index, count=2):
        self.index, self.ranks = index, list(range(count))
        self.prev_rank = index - 1 if index > 0 else None
        self.next_rank = index + 1 if index + 1 < count else None

    def name(self, index=None):
        index = self.index if index is None else index
        return f"stage {index} (rank {index})"


class Parts:
    def __init__(self):
        self.handed = 0
        self.relay_stream = 0
        self.sent = Event()
        self.received = Event()
        self.next_targets: list[int] = []
        self.direct_problem = None
        self.next_direct_problem = None
        self.meta_in = self.meta_out = None

    def acquire_event(self):
        return Event()


def persistent_tensors():
    return {"hidden": torch.full((MAX_ROWS, 8), float("nan")), "ids": torch.full((MAX_ROWS,), -7, dtype=torch.int64)}


class Link:
    """One auto link: a sending and a receiving transport over a real metadata socket and the simulated GPU."""

    def __init__(self, gpu: SimGPU, *, shared: bool = True, depth: int | str = "auto", persistent=None):
        hot = SimHot(gpu)
        auto = depth == "auto"
        slots = SLOTS if auto else depth
        self.persistent = persistent_tensors() if persistent is None else persistent
        specs = specs_from_persistent(self.persistent)
        layout = Layout.from_specs(specs)
        ring = Ring(layout, slots)
        self.slots = torch.zeros(ring.nbytes, dtype=torch.uint8)
        self.flags = torch.zeros(4, dtype=torch.int64)  # [receiver's full, sender's W]
        full, w = self.flags.data_ptr(), self.flags.data_ptr() + 8
        listener = meta_channel.Listener()
        fields = (2 if auto else 1) + len(specs)
        meta_out = meta_channel.connect(listener.name, listener.token, fields, 5.0, "test")
        meta_in = listener.accept(fields, 5.0, "test")
        listener.close()
        self.endpoints = (meta_out, meta_in)
        slot_addresses = [self.slots.data_ptr() + ring.slot_offset(k) for k in range(slots)]
        targets = [self.persistent[name].data_ptr() for name in layout.specs]

        send_parts = Parts()
        send_parts.relay_stream = gpu.stream()
        send_parts.meta_out = meta_out
        send_parts.next_targets = targets if shared else []
        send_parts.next_direct_problem = None if shared else "steps into stage 1 all go through a slot: test"
        self.sender = object.__new__(ce.CopyEngineTransport)
        self.sender.__dict__.update(
            _closed=False, _failure=None, _in_call=False, _stages=Stages(0), _send_layout=layout,
            _send_check=StepCheck(specs, torch.device("cpu"), "stage 1"), _send_step=0, _recv_step=0, depth="auto",
            _send_row_nbytes=[spec.row_nbytes for spec in specs.values()], _send_names=list(layout.specs),
            _next_slots=slot_addresses, _parts=send_parts, _hot=hot, _binding=Binding(), _index=0, _empty=w,
            _next_full=full, _last_send_stream=None, _watchdog=Watchdog(), _send_what="send step {} to stage 1",
        )
        self.sender.depth = depth
        self.sender._set_up_auto(auto, slots, 0)

        recv_parts = Parts()
        recv_parts.meta_in = meta_in
        recv_parts.direct_problem = None if shared else "steps into stage 1 all go through a slot: test"
        self.receiver = object.__new__(ce.CopyEngineTransport)
        self.receiver.__dict__.update(
            _closed=False, _failure=None, _in_call=False, _stages=Stages(1), _send_layout=None, _recv_step=0,
            depth="auto", _parts=recv_parts, _timeout_s=5.0, _recv_what="stage 1 receiving step {}",
            _recv_layout=layout, _recv_row_nbytes=[spec.row_nbytes for spec in specs.values()],
            _recv_slots=slot_addresses, _recv_targets=targets, _full=full, _prev_empty=w,
            _persistent=self.persistent, _binding=Binding(), _hot=hot, _watchdog=Watchdog(), _last_recv_stream=None,
            _index=0,
        )
        self.receiver.depth = depth
        self.receiver._set_up_auto(auto, slots, 0)

    def close(self):
        for endpoint in self.endpoints:
            endpoint.shutdown()
            endpoint.close()


def make_step(seed: int, step: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed * 7919 + step)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    pick = rng.random()
    rows = 0 if pick < 0.1 else MAX_ROWS if pick < 0.2 else rng.randint(0, MAX_ROWS)
    return {"hidden": torch.randn((rows, 8), generator=gen),
            "ids": torch.randint(-(2**40), 2**40, (rng.randint(0, MAX_ROWS),), generator=gen)}


def send_step(gpu: SimGPU, link: Link, data: dict[str, torch.Tensor]) -> None:
    """The producers fill fresh tensors on the current stream, send(), then the caller overwrites them there."""
    stream = _current.stream
    sources = {name: torch.full_like(value, -1) for name, value in data.items()}
    gpu.enqueue(stream, "call", lambda: [sources[n].copy_(data[n]) for n in data])
    link.sender.send(sources)
    gpu.enqueue(stream, "call", lambda: [t.fill_(-3) for t in sources.values()])


def recv_step(gpu: SimGPU, link: Link, log: list) -> None:
    """recv(), then a reader of what landed on the current stream (before anything queued later)."""
    out = link.receiver.recv()
    gpu.enqueue(_current.stream, "call", lambda: log.append({name: t.clone() for name, t in out.items()}))


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(got[name].shape == want[name].shape and torch.equal(got[name].view(torch.uint8) if got[name].numel()
               else got[name], want[name].view(torch.uint8) if want[name].numel() else want[name]) for name in want)


def run_hosts(gpu: SimGPU, bodies, links, patience_s: float = 2.0) -> list:
    """Run each body on a host thread of its own while this thread runs the GPU; raise Deadlock if all stall."""
    errors: list = []

    def host(body, stream):
        _current.stream = stream
        try:
            body()
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            errors.append(err)

    threads = [threading.Thread(target=host, args=(body, gpu.stream()), daemon=True) for body in bodies]
    for thread in threads:
        thread.start()
    idle_since = None
    while any(thread.is_alive() for thread in threads) or gpu.busy():
        if gpu.step():
            idle_since = None
            continue
        if errors:
            break
        now = time.monotonic()
        idle_since = idle_since or now
        if now - idle_since > patience_s:
            for link in links:  # unblock the hosts' metadata reads before reporting
                link.close()
            for thread in threads:
                thread.join(10)
            raise Deadlock("no stream could run and no host went on for "
                           f"{patience_s} s; heads: {[q[0] for q in gpu.queues.values() if q]}")
        time.sleep(0.0005)
    for thread in threads:
        thread.join(10)
    if errors:
        raise errors[0]
    return errors


def pause(rng: random.Random) -> None:
    if rng.random() < 0.4:
        time.sleep(rng.random() * 0.002)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shared", [True, False])
def test_streaming_through_the_transport_delivers_every_step_to_a_reader(seed, shared):
    gpu = SimGPU(random.Random(seed))
    link = Link(gpu, shared=shared)
    steps = 40
    log: list = []
    rng_s, rng_r = random.Random(seed + 10), random.Random(seed + 20)

    def sender():
        for step in range(1, steps + 1):
            pause(rng_s)
            if step % 4 == 0:  # slower than the receiver here: it has posted by then, so the step may go direct
                time.sleep(0.01)
            send_step(gpu, link, make_step(seed, step))

    def receiver():
        for _ in range(steps):
            pause(rng_r)
            recv_step(gpu, link, log)

    run_hosts(gpu, [sender, receiver], [link])
    assert len(log) == steps
    assert [same(got, make_step(seed, step)) for step, got in enumerate(log, 1)] == [True] * steps
    direct = link.sender.direct_steps_sent
    if shared:
        assert 0 < direct < steps, direct  # the paced hosts take both paths
        meta_paths = {bracket.ready is None for bracket in link.sender._watchdog.brackets}
        assert meta_paths == {True, False}  # direct brackets have no `ready`, relayed ones do
    else:
        assert direct == 0
    link.close()


def symmetric(seed: int, steps: int = 24):
    gpu = SimGPU(random.Random(seed))
    links = [Link(gpu), Link(gpu)]  # 0 -> 1 and 1 -> 0
    logs: list[list] = [[], []]
    rngs = [random.Random(seed + 10), random.Random(seed + 20)]

    def stage(me):
        def body():
            for step in range(1, steps + 1):
                pause(rngs[me])
                send_step(gpu, links[me], make_step(seed + me, step))
                recv_step(gpu, links[1 - me], logs[me])
        return body

    try:
        run_hosts(gpu, [stage(0), stage(1)], links)
    finally:
        for link in links:
            link.close()
    return logs, links


@pytest.mark.parametrize("seed", range(3))
def test_a_symmetric_exchange_through_the_transport_finishes_bit_exact(seed):
    logs, links = symmetric(seed)
    steps = len(logs[0])
    assert steps == 24 and len(logs[1]) == 24
    assert all(same(got, make_step(seed + 1, step)) for step, got in enumerate(logs[0], 1))
    assert all(same(got, make_step(seed, step)) for step, got in enumerate(logs[1], 1))


def test_the_same_exchange_deadlocks_when_direct_steps_ignore_posted(monkeypatch):
    # depth 0's rendezvous, through the transport: the control that shows the test above can fail.
    monkeypatch.setattr(AutoSender, "choose", lambda self, step, posted, nbytes: self.direct_possible)
    with pytest.raises(Deadlock):
        symmetric(0, steps=4)


def test_a_direct_step_the_receiver_did_not_post_is_refused_as_a_protocol_error(monkeypatch):
    gpu = SimGPU(random.Random(5))
    link = Link(gpu)
    # A sender that claims direct for step 1 although its peer never posted it (a bug or a foreign peer).
    monkeypatch.setattr(AutoSender, "choose", lambda self, step, posted, nbytes: True)
    _current.stream = gpu.stream()
    link.sender.send(make_step(5, 1))
    link.receiver._posting = False  # this receiver's post never went out
    with pytest.raises(ce.TransportFailedError, match=r"a direct step it may not send: this stage had not posted"):
        link.receiver.recv()
    assert link.receiver.error is not None
    link.close()


def test_a_garbage_post_makes_the_next_send_raise_and_the_transport_unusable():
    gpu = SimGPU(random.Random(6))
    link = Link(gpu)
    _current.stream = gpu.stream()
    link.endpoints[1]._sock.send((41).to_bytes(8, "little", signed=True))  # not recv(1)
    time.sleep(0.05)
    with pytest.raises(ce.TransportFailedError, match=r"posted recv\(41\) while step 1 is being sent"):
        link.sender.send(make_step(6, 1))
    assert not gpu.busy()  # nothing of the step was enqueued
    with pytest.raises(ce.TransportFailedError, match="protocol error"):
        link.sender.send(make_step(6, 1))
    link.close()


def test_a_receiver_gone_makes_the_next_send_raise_a_peer_timeout():
    gpu = SimGPU(random.Random(7))
    link = Link(gpu)
    _current.stream = gpu.stream()
    link.endpoints[1].close()
    time.sleep(0.05)
    with pytest.raises(ce.PeerTimeoutError, match="sending step 1: the next stage closed its metadata socket"):
        link.sender.send(make_step(7, 1))
    link.close()

"""``depth="auto"``'s protocol (``syncless.pp._auto``) against a simulated pair of GPUs, on the CPU.

The code under test is the transport's own: ``AutoSender`` and ``AutoReceiver`` enqueue exactly the
driver calls the transport makes, ``PostedLog`` checks the posted messages and ``choose_direct``
picks the path. Only the hardware is simulated:

- each stream is a queue; a copy lands 64 bytes at a time so other streams run in between, a batch's
  copies run in any order, flag waits and event waits hold their stream;
- the two hosts are generators that the scheduler interleaves at random with the GPU operations:
  a host may run far ahead of its GPU or fall behind it;
- a recv() host blocks until the step's metadata is there, as the socket read does.

A reader copies the persistent tensors on the receiver's stream after every step, the sender
poisons its sources on its stream right after every send(), and both hosts switch streams at
random. A step that lands wrong, too early or too late fails; a wait cycle raises ``Deadlock``.
"""

from __future__ import annotations

import collections
import random

import pytest

from syncless._core.errors import TransportFailedError
from syncless.pp import _auto
from syncless.pp._auto import AutoReceiver, AutoSender, PostedLog, choose_direct
from syncless.pp._layout import SLOT_ALIGN_BYTES, dense_spans

ROW_NBYTES = [32, 48]  # two tensors per step, like hidden and residual
MAX_ROWS = 6
SLOT_NBYTES = sum(-(-n * MAX_ROWS // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES for n in ROW_NBYTES)
POISON = 0xEE


class Deadlock(AssertionError):
    pass


class SimGPUs:
    """Two GPUs' memories in one address space, every stream a queue, events counted by generation."""

    def __init__(self, rng: random.Random):
        self.memory = {0: bytearray(1 << 16), 1: bytearray(1 << 16)}
        self.used = {0: 0, 1: 0}
        self.queues: dict[int, collections.deque] = {}
        self.recorded: collections.Counter = collections.Counter()
        self.reached: collections.Counter = collections.Counter()
        self.rng = rng

    def alloc(self, gpu: int, nbytes: int) -> int:
        offset = self.used[gpu]
        self.used[gpu] = offset + -(-nbytes // 256) * 256
        if self.used[gpu] > len(self.memory[gpu]):
            raise MemoryError("the simulated GPU is full")
        return ((gpu + 1) << 40) + offset

    def at(self, address: int) -> tuple[bytearray, int]:
        return self.memory[(address >> 40) - 1], address & ((1 << 40) - 1)

    def read(self, address: int, nbytes: int) -> bytes:
        memory, offset = self.at(address)
        return bytes(memory[offset:offset + nbytes])

    def fill(self, address: int, data: bytes) -> None:
        memory, offset = self.at(address)
        memory[offset:offset + len(data)] = data

    def read64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    def stream(self) -> int:
        sid = len(self.queues) + 1
        self.queues[sid] = collections.deque()
        return sid

    def call(self, stream: int, fn) -> None:
        self.queues[stream].append(("call", fn))

    def _runnable(self, op: tuple) -> bool:
        if op[0] == "wait":
            return self.read64(op[1]) >= op[2]
        if op[0] == "wait_event":
            return self.reached[op[1]] >= op[2]
        return True

    def ready(self) -> list[int]:
        return [sid for sid, queue in self.queues.items() if queue and self._runnable(queue[0])]

    def busy(self) -> bool:
        return any(self.queues.values())

    def execute(self, sid: int) -> None:
        op = self.queues[sid].popleft()
        kind = op[0]
        if kind == "copy":
            _, dst, src, nbytes = op
            piece = min(nbytes, 64)
            self.fill(dst, self.read(src, piece))
            if piece < nbytes:
                self.queues[sid].appendleft(("copy", dst + piece, src + piece, nbytes - piece))
        elif kind == "batch":
            copies = list(op[1])
            self.rng.shuffle(copies)
            for dst, src, nbytes in reversed(copies):
                self.queues[sid].appendleft(("copy", dst, src, nbytes))
        elif kind == "write":
            self.fill(op[1], op[2].to_bytes(8, "little"))
        elif kind == "record":
            self.reached[op[1]] = max(self.reached[op[1]], op[2])
        elif kind == "call":
            op[1]()


class SimHot:
    """``_driver.Hot``'s six calls, enqueued on the simulation."""

    def __init__(self, sim: SimGPUs):
        self.sim = sim

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.sim.queues[stream].append(("copy", dst, src, nbytes))

    def memcpy_all(self, copies, stream: int) -> None:
        self.sim.queues[stream].append(("batch", list(copies)))

    def wait_geq(self, stream: int, address: int, value: int) -> None:
        self.sim.queues[stream].append(("wait", address, value))

    def write(self, stream: int, address: int, value: int) -> None:
        self.sim.queues[stream].append(("write", address, value))

    def record(self, event, stream: int) -> None:
        self.sim.recorded[event] += 1
        self.sim.queues[stream].append(("record", event, self.sim.recorded[event]))

    def wait_event(self, event, stream: int) -> None:
        # CUDA: the wait is for the latest record enqueued before it (none yet: nothing to wait for).
        self.sim.queues[stream].append(("wait_event", event, self.sim.recorded[event]))


class Event:
    """A simulated event (identity is all that matters)."""


class Link:
    """One auto link from ``src`` to ``dst``: the flags, slots and persistent tensors, and the two hosts' halves.

    ``policy`` picks each step's path: ``"auto"`` (the transport's rule), ``"slot"`` (never direct),
    ``"direct"`` (direct whenever the rule allows), ``"random"`` (a coin where it allows), or
    ``"rendezvous"`` (direct always, ignoring whether the receiver posted: depth 0's behaviour).
    """

    def __init__(self, sim: SimGPUs, src: int, dst: int, *, slots: int, policy: str, direct_possible: bool = True,
                 rng: random.Random):
        self.sim, self.src, self.dst, self.policy, self.rng = sim, src, dst, policy, rng
        hot = SimHot(sim)
        self.full = sim.alloc(dst, 8)
        self.w = sim.alloc(src, 8)
        self.slots = [sim.alloc(dst, SLOT_NBYTES) for _ in range(slots)]
        self.persistent = [sim.alloc(dst, n * MAX_ROWS) for n in ROW_NBYTES]
        for target, n in zip(self.persistent, ROW_NBYTES):
            sim.fill(target, bytes([POISON]) * n * MAX_ROWS)
        self.relay = sim.stream()
        self.sender = AutoSender(hot, Event, slots=slots, peer_slots=self.slots,
                                 targets=self.persistent if direct_possible else None, peer_full=self.full,
                                 own_w=self.w, relay=self.relay, sent=Event(), min_nbytes=0)
        self.receiver = AutoReceiver(hot, slots=self.slots, targets=self.persistent, own_full=self.full,
                                     peer_w=self.w, received=Event())
        self.log = PostedLog("sim link")
        self.posted_msgs: collections.deque = collections.deque()  # receiver -> sender, "posted N"
        self.meta: collections.deque = collections.deque()  # sender -> receiver: (step, direct, rows)
        self.posted_here = 0  # the receiver's last post
        self.direct_steps = 0
        self.sent_steps = 0
        self.received_steps = 0

    # The sending host ---------------------------------------------------------------

    def choose(self, step: int, posted: int, nbytes: int) -> bool:
        allowed = choose_direct(step, posted, self.sender.direct_possible, nbytes, 0)
        if self.policy == "auto":
            return self.sender.choose(step, posted, nbytes)
        if self.policy == "slot":
            return False
        if self.policy == "direct":
            return allowed
        if self.policy == "random":
            return allowed and self.rng.random() < 0.5
        if self.policy == "rendezvous":
            return self.sender.direct_possible
        raise ValueError(self.policy)

    def send(self, stream: int, sources: list[int], rows: list[int]) -> None:
        """send(): everything the transport's ``_send_auto`` does, the socket replaced by deques."""
        step = self.sent_steps + 1
        values = list(self.posted_msgs)
        self.posted_msgs.clear()
        posted = self.log.accept(values, step)
        spans, _ = dense_spans(ROW_NBYTES, rows)
        direct = self.choose(step, posted, sum(n for _, n in spans))
        destinations = self.sender.destinations(step, direct, [offset for offset, _ in spans])
        copies = [(d, s, n) for d, s, (_, n) in zip(destinations, sources, spans) if n]
        plan = self.sender.plan(direct, stream)
        self.sender.enqueue(plan, step, copies)
        self.meta.append((step, direct, list(rows)))
        self.sent_steps = step
        self.direct_steps += direct

    # The receiving host ---------------------------------------------------------------

    def recv_enter(self, stream: int) -> int:
        step = self.received_steps + 1
        self.receiver.enter(step, stream)
        self.posted_msgs.append(step)  # after the entry write is enqueued, as the transport posts
        self.posted_here = step
        return step

    def recv_finish(self, step: int, stream: int) -> list[int]:
        got, direct, rows = self.meta.popleft()
        assert got == step
        assert not direct or self.posted_here == step, "a direct step the receiver had not posted"
        spans, _ = dense_spans(ROW_NBYTES, rows)
        self.receiver.finish(step, direct, spans, stream, Event(), Event())
        self.received_steps = step
        return rows


def payload(seed: int, link: int, step: int, rows: list[int]) -> list[bytes]:
    rng = random.Random(seed * 1_000_003 + link * 10_007 + step)
    return [rng.randbytes(n * r) for n, r in zip(ROW_NBYTES, rows)]


def random_rows(rng: random.Random) -> list[int]:
    pick = rng.random()
    if pick < 0.15:
        return [0, 0]
    if pick < 0.3:
        return [MAX_ROWS, MAX_ROWS]
    return [rng.randint(0, MAX_ROWS) for _ in ROW_NBYTES]


class Stage:
    """One host: its GPU's caller streams, and the user-side stream fences a real stage would have."""

    def __init__(self, sim: SimGPUs, gpu: int, rng: random.Random, streams: int, *, fence: bool = True):
        self.sim, self.gpu, self.rng, self.fence = sim, gpu, rng, fence
        self.streams = [sim.stream() for _ in range(streams)]
        self.previous: int | None = None
        self.hot = SimHot(sim)

    def pick_stream(self) -> int:
        """A random stream; with ``fence``, ordered after the previous one (the user's wait_stream).

        A receiver fences (its reader of step N must come before step N+1 rewrites the persistent
        tensors, as in any real stage); a sender does not, so only the transport keeps its steps in order.
        """
        stream = self.rng.choice(self.streams)
        if self.fence and self.previous is not None and self.previous != stream:
            fence = Event()
            self.hot.record(fence, self.previous)
            self.hot.wait_event(fence, stream)
        self.previous = stream
        return stream

    def produce(self, stream: int, data: list[bytes]) -> list[int]:
        """Fresh source buffers, filled on ``stream`` (the producers of the step)."""
        sources = [self.sim.alloc(self.gpu, max(len(d), 8)) for d in data]
        for address, chunk in zip(sources, data):
            self.sim.call(stream, lambda a=address, c=chunk: self.sim.fill(a, c))
        return sources

    def poison_after(self, stream: int, sources: list[int], data: list[bytes]) -> None:
        """The caller overwrites its tensors right after send(), on the same stream."""
        for address, chunk in zip(sources, data):
            self.sim.call(stream, lambda a=address, n=len(chunk): self.sim.fill(a, bytes([POISON]) * n))


def read_rows(sim: SimGPUs, link: Link, rows: list[int]) -> list[bytes]:
    return [sim.read(target, n * r) for target, n, r in zip(link.persistent, ROW_NBYTES, rows)]


def run(sim: SimGPUs, hosts: list, rng: random.Random) -> None:
    """Interleave the hosts (generators yielding None, or a predicate to block on) with the GPU at random."""
    blocked = {i: None for i in range(len(hosts))}
    live = set(range(len(hosts)))
    while live or sim.busy():
        hosts_ready = [i for i in live if blocked[i] is None or blocked[i]()]
        gpu_ready = sim.ready()
        if not hosts_ready and not gpu_ready:
            stuck = {sid: queue[0] for sid, queue in sim.queues.items() if queue}
            raise Deadlock(f"no host and no stream can go on; hosts {sorted(live)} blocked, stream heads {stuck}")
        if hosts_ready and (not gpu_ready or rng.random() < 0.3):
            i = rng.choice(hosts_ready)
            try:
                blocked[i] = next(hosts[i])
            except StopIteration:
                live.discard(i)
        else:
            sim.execute(rng.choice(gpu_ready))


def sender_host(stage: Stage, link: Link, steps: int, seed: int, index: int, rows_of):
    for step in range(1, steps + 1):
        if stage.rng.random() < 0.5:
            # A host slower than its receiver's (it computed first): recv(step) is posted by the time it sends.
            yield lambda s=step: link.posted_here >= s
        stream = stage.pick_stream()
        rows = rows_of(step)
        data = payload(seed, index, step, rows)
        sources = stage.produce(stream, data)
        link.send(stream, sources, rows)
        stage.poison_after(stream, sources, data)
        yield None


def receiver_host(stage: Stage, link: Link, steps: int, log: list):
    for _ in range(steps):
        stream = stage.pick_stream()
        step = link.recv_enter(stream)
        yield None
        yield lambda: bool(link.meta)  # the metadata read blocks until the step's message is there
        rows = link.recv_finish(step, stream)
        stage.sim.call(stream, lambda r=rows: log.append(read_rows(stage.sim, link, r)))
        yield None


def streaming(seed: int, policy: str, slots: int = 2, steps: int = 24, direct_possible: bool = True):
    rng = random.Random(seed)
    sim = SimGPUs(rng)
    link = Link(sim, 0, 1, slots=slots, policy=policy, direct_possible=direct_possible, rng=random.Random(seed + 1))
    sender = Stage(sim, 0, random.Random(seed + 2), 2, fence=False)
    receiver = Stage(sim, 1, random.Random(seed + 3), 2)
    row_rng = random.Random(seed + 4)
    rows = {step: random_rows(row_rng) for step in range(1, steps + 1)}
    log: list = []
    run(sim, [sender_host(sender, link, steps, seed, 0, rows.__getitem__), receiver_host(receiver, link, steps, log)],
        rng)
    expected = [payload(seed, 0, step, rows[step]) for step in range(1, steps + 1)]
    return log, expected, link


POLICIES = ["auto", "slot", "direct", "random"]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("slots", [2, 3])
def test_streaming_delivers_every_step_to_a_reader_whatever_the_path(policy, seed, slots):
    log, expected, link = streaming(seed, policy, slots)
    assert log == expected
    if policy == "slot":
        assert link.direct_steps == 0


def test_the_schedules_mix_both_paths():
    # Otherwise the test above would not exercise the switch between paths.
    counts = [streaming(seed, "direct")[2].direct_steps for seed in range(8)]
    assert all(4 < count < 20 for count in counts), counts


def test_a_link_without_shared_tensors_runs_slot_only():
    for seed in range(4):
        log, expected, link = streaming(seed, "direct", direct_possible=False)
        assert log == expected and link.direct_steps == 0


def exchange(seed: int, policy: str, steps: int = 12, *, echo: bool = False):
    """Two links in opposite directions on one stream per stage.

    ``echo`` False: a symmetric exchange, both stages send step N before they receive step N.
    ``echo`` True: a ping-pong, stage 1 receives step N and sends it back from its persistent tensors.
    """
    rng = random.Random(seed)
    sim = SimGPUs(rng)
    links = [Link(sim, 0, 1, slots=2, policy=policy, rng=random.Random(seed + 1)),
             Link(sim, 1, 0, slots=2, policy=policy, rng=random.Random(seed + 2))]
    stages = [Stage(sim, 0, random.Random(seed + 3), 1), Stage(sim, 1, random.Random(seed + 4), 1)]
    row_rng = random.Random(seed + 5)
    rows = {step: random_rows(row_rng) for step in range(1, steps + 1)}
    logs: list[list] = [[], []]

    def symmetric(me: int):
        stage, out, into = stages[me], links[me], links[1 - me]
        for step in range(1, steps + 1):
            stream = stage.streams[0]
            data = payload(seed, me, step, rows[step])
            sources = stage.produce(stream, data)
            out.send(stream, sources, rows[step])
            stage.poison_after(stream, sources, data)
            yield None
            got = into.recv_enter(stream)
            yield lambda: bool(into.meta)
            got_rows = into.recv_finish(got, stream)
            sim.call(stream, lambda r=got_rows, link=into: logs[me].append(read_rows(sim, link, r)))
            yield None

    def echoing():
        stage, into, out = stages[1], links[0], links[1]
        for _ in range(1, steps + 1):
            stream = stage.streams[0]
            got = into.recv_enter(stream)
            yield lambda: bool(into.meta)
            got_rows = into.recv_finish(got, stream)
            sim.call(stream, lambda r=got_rows: logs[1].append(read_rows(sim, into, r)))
            out.send(stream, list(into.persistent), got_rows)  # straight from the persistent tensors
            yield None

    hosts = [symmetric(0), echoing() if echo else symmetric(1)]
    run(sim, hosts, rng)
    return logs, rows, links


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", POLICIES)
def test_a_symmetric_exchange_never_deadlocks_and_delivers_every_step(policy, seed):
    logs, rows, links = exchange(seed, policy)
    steps = len(rows)
    assert logs[1] == [payload(seed, 0, step, rows[step]) for step in range(1, steps + 1)]
    assert logs[0] == [payload(seed, 1, step, rows[step]) for step in range(1, steps + 1)]


def test_a_symmetric_exchange_does_go_direct_under_the_posted_rule():
    assert sum(link.direct_steps for seed in range(8) for link in exchange(seed, "direct")[2]) > 0


@pytest.mark.parametrize("seed", range(4))
def test_the_same_exchange_deadlocks_when_direct_steps_ignore_posted(seed):
    # depth 0's rendezvous: without the posted rule both first sends wait for the other stage's recv().
    with pytest.raises(Deadlock):
        exchange(seed, "rendezvous")


def prefill_then_collect(seed: int, policy: str) -> None:
    """X sends 3 steps back to back, then receives 3; Y receives each, and sends it back at once.

    Y's host reaches recv(1) before X sends, and X's host posts its first receive before Y sends: so X's
    step 1 and Y's step 1 go direct under ``auto``.
    """
    rng = random.Random(seed)
    sim = SimGPUs(rng)
    out = Link(sim, 0, 1, slots=2, policy=policy, rng=random.Random(seed + 1))  # X -> Y
    back = Link(sim, 1, 0, slots=2, policy=policy, rng=random.Random(seed + 2))  # Y -> X
    x, y = Stage(sim, 0, random.Random(seed + 3), 1), Stage(sim, 1, random.Random(seed + 4), 1)
    rows, steps = [2, 3], 3

    def x_host():
        stream = x.streams[0]
        yield lambda: out.posted_here >= 1
        for step in range(1, steps + 1):
            data = payload(seed, 0, step, rows)
            src = x.produce(stream, data)
            out.send(stream, src, rows)
            x.poison_after(stream, src, data)
            yield None
        for _ in range(steps):
            entered = back.recv_enter(stream)
            yield lambda: bool(back.meta)
            back.recv_finish(entered, stream)
            yield None

    def y_host():
        stream = y.streams[0]
        for step in range(1, steps + 1):
            entered = out.recv_enter(stream)
            yield lambda: bool(out.meta)
            got = out.recv_finish(entered, stream)
            yield None
            if step == 1:
                yield lambda: back.posted_here >= 1
            back.send(stream, list(out.persistent), got)
            yield None

    run(sim, [x_host(), y_host()], rng)


@pytest.mark.parametrize("seed", range(12))
def test_a_direct_step_frees_its_slot_so_prefill_then_collect_finishes(seed):
    """Found in review: a direct step N left slot step N+D waiting for recv(N+1)'s entry, one slot fewer in flight;
    this exchange, which finishes at depth 2, then deadlocked. The end of every recv() now writes W = 2N."""
    prefill_then_collect(seed, "auto")
    prefill_then_collect(seed, "slot")


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", POLICIES)
def test_a_ping_pong_echoes_every_step(policy, seed):
    logs, rows, links = exchange(seed, policy, echo=True)
    expected = [payload(seed, 0, step, rows[step]) for step in range(1, len(rows) + 1)]
    assert logs[1] == expected and logs[0] == expected


# -- tests that can fail: each ordering removed in turn must show up as a wrong step or a deadlock -----------


def _wrong_or_stuck(policy: str, seeds: range = range(12)) -> int:
    bad = 0
    for seed in seeds:
        try:
            log, expected, _ = streaming(seed, policy)
        except Deadlock:
            bad += 1
            continue
        bad += log != expected
    return bad


def test_the_simulation_catches_a_slot_reused_too_early(monkeypatch):
    monkeypatch.setattr(_auto, "slot_wait_value", lambda step, slots: None)
    assert _wrong_or_stuck("slot") > 0


def test_the_simulation_catches_a_direct_step_that_does_not_wait_for_recv(monkeypatch):
    monkeypatch.setattr(_auto, "direct_wait_value", lambda step: 0)
    assert _wrong_or_stuck("direct") > 0


def test_the_simulation_catches_steps_overtaking_across_streams(monkeypatch):
    # Without the `sent` wait a slot step on the relay could write `full` before the direct step before it.
    original = AutoSender.enqueue

    def without_order(self, plan, step, copies):
        self.last_stream = None
        original(self, plan, step, copies)

    monkeypatch.setattr(AutoSender, "enqueue", without_order)
    assert _wrong_or_stuck("random", range(30)) > 0


def test_the_simulation_catches_a_copy_out_that_frees_its_slot_early(monkeypatch):
    def free_first(self, step, direct, spans, stream, pre, post):
        if not direct:  # W = 2N before the copy out of the slot, not after it
            self.hot.write(stream, self.peer_w, _auto.copied_out_value(step))
        original(self, step, direct, spans, stream, pre, post)

    original = AutoReceiver.finish
    monkeypatch.setattr(AutoReceiver, "finish", free_first)
    assert _wrong_or_stuck("slot") > 0


# -- the posted messages ---------------------------------------------------------------------------------


def test_posted_values_are_taken_in_order_up_to_the_step_being_sent():
    log = PostedLog("stage 0")
    assert log.accept([], 1) == 0
    assert log.accept([1], 1) == 1
    assert log.accept([2], 2) == 2
    assert log.accept([3], 3) == 3 and log.accept([], 4) == 3 and log.accept([4], 4) == 4


@pytest.mark.parametrize("values, sending, words", [
    ([1, 1], 5, "posted recv(1) while step 5 is being sent (expected 2"),  # a replay
    ([2], 5, "posted recv(2) while step 5 is being sent (expected 1"),  # a gap
    ([1, 3], 5, "expected 2"),  # out of order
    ([-7], 5, "expected 1"),  # garbage
    ([1 << 62], 5, "expected 1"),  # garbage
    ([1, 2], 1, "posted recv(2) while step 1 is being sent (ahead of the steps sent"),
])
def test_posted_values_out_of_order_are_a_protocol_error(values, sending, words):
    log = PostedLog("stage 0 (rank 0) sending to stage 1 (rank 1)")
    with pytest.raises(TransportFailedError, match="protocol error") as info:
        log.accept(values, sending)
    assert words in str(info.value) and "stage 0 (rank 0) sending to stage 1 (rank 1)" in str(info.value)


@pytest.mark.parametrize("step, posted, possible, nbytes, floor, direct", [
    (3, 3, True, 100, 0, True),
    (3, 2, True, 100, 0, False),  # not posted yet
    (3, 5, True, 100, 0, True),
    (3, 3, False, 100, 0, False),  # the receiver shared nothing
    (3, 3, True, 100, 101, False),  # below SYNCLESS_PP_AUTO_DIRECT_MIN_BYTES
    (3, 3, True, 101, 101, True),
    (3, 3, True, 0, 0, False),  # a step of no bytes: no copy-out to save, only the rendezvous to pay
])
def test_choose_direct_needs_the_post_shared_tensors_and_the_size(step, posted, possible, nbytes, floor, direct):
    assert choose_direct(step, posted, possible, nbytes, floor) is direct


def test_w_values_follow_the_design():
    assert [_auto.entry_value(n) for n in (1, 2, 3)] == [1, 3, 5]
    assert [_auto.copied_out_value(n) for n in (1, 2, 3)] == [2, 4, 6]
    assert [_auto.slot_wait_value(n, 2) for n in (1, 2, 3, 4)] == [None, None, 2, 4]
    with pytest.raises(ValueError, match="at least 2 slots"):
        AutoSender(None, Event, slots=1, peer_slots=[0], targets=None, peer_full=0, own_w=0, relay=0, sent=None,
                   min_nbytes=0)

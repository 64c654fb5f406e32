"""What the copy-engine transport delivers at depth 0, 2 and ``"auto"``, on the CPU with only the GPU simulated.

The transports are the real ``CopyEngineTransport`` objects of ``test_auto_transport_cpu`` (its
``Link``: a real metadata socket pair, a simulated GPU running their driver calls on the tensors'
real addresses). Checked here: a step may carry any subset of the layout's keys and the receiver
gets exactly those, bit-exact; a key outside the layout is a clear error; conjugate and negative
views go out as their values, not as their raw bytes.
"""

from __future__ import annotations

import importlib.util
import pathlib
import random
import time

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "auto_transport_cpu", pathlib.Path(__file__).with_name("test_auto_transport_cpu.py")
)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

pytestmark = pytest.mark.timeout(120)

MAX_ROWS = 6
DEPTHS = [0, 2, "auto"]
SHAPES = {"hidden": ((8,), torch.float32), "ids": ((), torch.int64), "z": ((3,), torch.complex64)}


def persistent_tensors() -> dict[str, torch.Tensor]:
    out = {name: torch.empty((MAX_ROWS, *row), dtype=dtype) for name, (row, dtype) in SHAPES.items()}
    for tensor in out.values():
        tensor.view(torch.uint8).fill_(0xA5)  # poison: any byte not written by a step shows
    return out


@pytest.fixture(autouse=True)
def simulated_streams(monkeypatch):
    """torch's current stream, per host thread, as the simulation's stream ids."""
    monkeypatch.setattr(sim.ce, "_current_stream", lambda index: sim._current.stream)


@pytest.fixture
def kept(monkeypatch):
    """Keep each step's contiguous temporaries alive until the simulated GPU has run.

    On a real GPU the caching allocator reuses a freed temporary only behind the copies on the
    stream; the simulation has no such allocator, so the test holds them (a stand-in for hardware).
    """
    held: list = []
    original = sim.ce.CopyEngineTransport._step_copies

    def holding(self, tensors, destinations, spans):
        dense, copies = original(self, tensors, destinations, spans)
        held.append(dense)
        return dense, copies

    monkeypatch.setattr(sim.ce.CopyEngineTransport, "_step_copies", holding)
    return held


def subset_step(seed: int, step: int) -> dict[str, torch.Tensor]:
    """A random subset of the keys (the empty one and the full one included), each with random rows."""
    rng = random.Random(seed * 7919 + step)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    pick = rng.random()
    names = [] if pick < 0.1 else list(SHAPES) if pick < 0.2 else [n for n in SHAPES if rng.random() < 0.5]
    out = {}
    for name in names:
        row, dtype = SHAPES[name]
        rows = rng.randint(0, MAX_ROWS)
        if dtype.is_floating_point or dtype.is_complex:
            out[name] = torch.randn((rows, *row), dtype=dtype, generator=gen)
        else:
            out[name] = torch.randint(-(2**40), 2**40, (rows, *row), generator=gen)
    return out


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as bytes (conjugate and negative bits applied first)."""
    return tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(
        got[n].shape == want[n].shape and torch.equal(raw(got[n]), raw(want[n])) for n in want
    )


def stream_steps(depth, steps, make, seed):
    gpu = sim.SimGPU(random.Random(seed))
    link = sim.Link(gpu, depth=depth, persistent=persistent_tensors())
    log: list = []
    rng_s, rng_r = random.Random(seed + 10), random.Random(seed + 20)
    sent: list = []

    def sender():
        for step in range(1, steps + 1):
            sim.pause(rng_s)
            data = make(seed, step)
            sent.append(data)  # held until the GPU ran: the sources stay untouched, so the bytes compare
            link.sender.send(data)

    def receiver():
        for _ in range(steps):
            sim.pause(rng_r)
            sim.recv_step(gpu, link, log)

    try:
        sim.run_hosts(gpu, [sender, receiver], [link])
    finally:
        link.close()
    return log, sent, link


@pytest.mark.parametrize("depth", DEPTHS)
def test_a_step_may_carry_any_subset_of_the_keys_and_the_receiver_gets_exactly_those(depth, kept):
    log, sent, link = stream_steps(depth, 40, subset_step, seed=3)
    assert len(log) == 40
    assert [sorted(got) for got in log] == [sorted(want) for want in sent]
    assert [same(got, want) for got, want in zip(log, sent)] == [True] * 40
    assert any(0 < len(want) < len(SHAPES) for want in sent) and any(not want for want in sent)


@pytest.mark.parametrize("depth", DEPTHS)
def test_a_key_outside_the_layout_is_a_clear_error_and_nothing_is_enqueued(depth, kept):
    gpu = sim.SimGPU(random.Random(1))
    link = sim.Link(gpu, depth=depth, persistent=persistent_tensors())
    sim._current.stream = gpu.stream()
    try:
        with pytest.raises(ValueError, match=r"unknown \['bogus'\]") as info:
            link.sender.send({"hidden": torch.zeros(2, 8), "bogus": torch.zeros(2, 8)})
        assert "any subset" in str(info.value) and "'hidden', 'ids', 'z'" in str(info.value)
        with pytest.raises(TypeError, match=r"\['ids'\] must be a torch.Tensor"):
            link.sender.send({"ids": None})
        assert not gpu.busy() and link.sender.error is None
    finally:
        link.close()


def conj_neg_step(seed: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + step)
    z = torch.randn((MAX_ROWS, 3), dtype=torch.complex64, generator=gen)
    h = torch.randn((MAX_ROWS - 1, 8), generator=gen)
    views = {"z": z.conj() if step % 2 else torch._neg_view(z), "hidden": torch._neg_view(h)}
    if step % 3 == 0:  # a conjugate negative view, not contiguous either
        views["z"] = torch._neg_view(torch.randn((3, MAX_ROWS), dtype=torch.complex64, generator=gen).t().conj())
    return views


@pytest.mark.parametrize("depth", DEPTHS)
def test_conjugate_and_negative_views_go_out_as_their_values(depth, kept):
    log, sent, _ = stream_steps(depth, 6, conj_neg_step, seed=5)
    assert any(t.is_conj() for step in sent for t in step.values())
    assert all(t.is_neg() or t.is_conj() for step in sent for t in step.values())
    assert [same(got, want) for got, want in zip(log, sent)] == [True] * 6


class SimStream:
    """What ``ReceivedStep.wait(stream)`` reads of a ``torch.cuda.Stream``: its raw handle."""

    def __init__(self, handle: int):
        self.cuda_stream = handle


def _drain(gpu) -> None:
    while gpu.step():
        pass
    assert not gpu.busy(), [q[0] for q in gpu.queues.values() if q]


def _full_waits(queue, address) -> list[int]:
    return [i for i, op in enumerate(queue) if op[0] == "wait" and op[1] == address]


@pytest.mark.parametrize("depth", DEPTHS)
def test_recv_wait_false_queues_the_gpu_wait_at_first_use_behind_the_input_preparation(depth, kept):
    gpu = sim.SimGPU(random.Random(2))
    link = sim.Link(gpu, depth=depth, persistent=persistent_tensors())
    send_stream, recv_stream = gpu.stream(), gpu.stream()
    try:
        data = subset_step(11, 7) or {"ids": torch.arange(3)}
        sim._current.stream = send_stream
        link.sender.send(data)
        sim._current.stream = recv_stream
        step = link.receiver.recv(wait=False)
        assert sorted(step) == sorted(data) and len(step) == len(data) and not step.waited
        queue = gpu.queues[recv_stream]
        assert _full_waits(queue, link.receiver._full) == []  # recv() queued no wait for the data
        prepared = []
        gpu.enqueue(recv_stream, "call", lambda: prepared.append(len(prepared)))  # input preparation
        views = {name: step[name] for name in step}  # first use: the wait goes in now, behind the preparation
        waits = _full_waits(queue, link.receiver._full)
        assert step.waited and len(waits) == 1
        assert [op[0] for op in queue].index("call") < waits[0]
        log = []
        gpu.enqueue(recv_stream, "call", lambda: log.append({n: t.clone() for n, t in views.items()}))
        _drain(gpu)
        assert prepared == [0] and same(log[0], data)
    finally:
        link.close()


@pytest.mark.parametrize("depth", DEPTHS)
def test_deferred_steps_stream_bit_exact_whether_used_on_another_stream_or_never(depth, kept):
    gpu = sim.SimGPU(random.Random(4))
    link = sim.Link(gpu, depth=depth, persistent=persistent_tensors())
    steps = 30
    log: dict = {}
    sent: list = []
    rng = random.Random(8)

    def sender():
        for step in range(1, steps + 1):
            sim.pause(rng)
            data = subset_step(5, step)
            sent.append(data)
            link.sender.send(data)

    def receiver():
        other = gpu.stream()
        for step in range(1, steps + 1):
            out = link.receiver.recv(wait=False)
            if step % 5 == 0:
                log[step] = None  # never used: the next recv() enqueues it first
                continue
            if step % 3 == 0:  # used on another stream: that stream waits for the step's end
                views, stream = out.wait(SimStream(other)), other
            else:
                views, stream = out.tensors, sim._current.stream
            def read(v=views, k=step):
                log[k] = {n: t.clone() for n, t in v.items()}

            gpu.enqueue(stream, "call", read)
            # the next recv() must not overwrite before this reader: order it on the receiving stream
            if stream != sim._current.stream:
                event = sim.Event()
                sim.SimHot(gpu).record(event, stream)
                sim.SimHot(gpu).wait_event(event, sim._current.stream)

    try:
        sim.run_hosts(gpu, [sender, receiver], [link])
    finally:
        link.close()
    assert sorted(log) == list(range(1, steps + 1))
    assert [k for k, g in log.items() if g is None] == list(range(5, steps + 1, 5))
    wrong = [k for k, g in log.items() if g is not None and not same(g, sent[k - 1])]
    assert wrong == []


class _Prefer(random.Random):
    """The simulated GPU's scheduler, running ``stream`` whenever it can: a reader there races the copy-in."""

    def __init__(self, seed: int, stream: int):
        super().__init__(seed)
        self.stream = stream

    def choice(self, ready):
        return self.stream if self.stream in ready else super().choice(ready)


@pytest.mark.parametrize("how", ["wait(stream)", "current stream"])
@pytest.mark.parametrize("depth", DEPTHS)
def test_every_later_stream_that_reads_a_deferred_step_is_ordered_after_its_data(depth, how, kept):
    # The first use fences one stream; a reader on a second stream (given to wait(), or current when it
    # reads a key) must wait for the step's data too, however eagerly the GPU runs that stream.
    gpu = sim.SimGPU(random.Random(0))
    link = sim.Link(gpu, depth=depth, persistent=persistent_tensors())
    send_stream, recv_stream, first_reader, late_reader = (gpu.stream() for _ in range(4))
    gpu.rng = _Prefer(3, late_reader)
    try:
        data = {"hidden": torch.randn(MAX_ROWS, 8), "ids": torch.randint(-(2**40), 2**40, (4,))}
        sim._current.stream = send_stream
        link.sender.send(data)
        sim._current.stream = recv_stream
        step = link.receiver.recv(wait=False)
        step.wait(SimStream(first_reader))
        if how == "wait(stream)":
            views = step.wait(SimStream(late_reader))
        else:
            sim._current.stream = late_reader
            views = {name: step[name] for name in step}
        before = len(gpu.queues[late_reader])
        step.wait(SimStream(late_reader))
        _ = step["ids"]
        assert len(gpu.queues[late_reader]) == before  # once per stream
        log = []
        gpu.enqueue(late_reader, "call", lambda: log.append({n: t.clone() for n, t in views.items()}))
        _drain(gpu)
        assert same(log[0], data)
    finally:
        link.close()


def test_recv_takes_only_a_bool_and_names_the_seeds_recv_pp_group(kept):
    gpu = sim.SimGPU(random.Random(9))
    link = sim.Link(gpu, depth=2, persistent=persistent_tensors())
    sim._current.stream = gpu.stream()
    try:
        data = {"ids": torch.arange(3)}
        link.sender.send(data)
        for wait in (object(), None, 0):
            with pytest.raises(TypeError, match=r"recv\(wait=\.\.\.\) takes a bool; got .*recv\(pp_group\)"):
                link.receiver.recv(wait)
        assert link.receiver.error is None
        out = link.receiver.recv()  # the step was not consumed by the refused calls
        log = []
        gpu.enqueue(sim._current.stream, "call", lambda: log.append(out["ids"].clone()))
        _drain(gpu)
        assert torch.equal(log[0], data["ids"])
    finally:
        link.close()


def test_a_recv_blocked_in_the_metadata_socket_raises_the_aborts_error(kept):
    # What abort() does for a recv() on another thread: record its error, then shut the metadata socket.
    import threading

    from syncless._core.errors import TransportFailedError

    gpu = sim.SimGPU(random.Random(10))
    link = sim.Link(gpu, depth=2, persistent=persistent_tensors())
    raised = []

    def receive():
        sim._current.stream = gpu.stream()
        try:
            link.receiver.recv()
        except BaseException as err:  # noqa: BLE001 - the test checks which error it was
            raised.append(err)

    thread = threading.Thread(target=receive)
    thread.start()
    time.sleep(0.2)  # recv() is blocked reading the metadata (nobody sends)
    aborted = TransportFailedError("stage 1 (rank 1): this transport was aborted")
    link.receiver._failure = aborted
    link.endpoints[1].shutdown()
    thread.join(10)
    try:
        assert raised and raised[0] is aborted and link.receiver.error is aborted
    finally:
        link.close()

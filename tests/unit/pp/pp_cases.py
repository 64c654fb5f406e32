"""Rank bodies for the pipeline-transport tests, shared by the CPU, GPU and multi-GPU suites.

Each body runs in every rank (see ``support.ranks.run_ranks``) and returns
what the parent asserts on. Device-agnostic: ``kind`` is ``"cpu"`` or
``"cuda"`` (the rank's current CUDA device, set by ``run_ranks(devices=...)``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time

import torch
import torch.distributed as dist

from support.ranks import say
from syncless.pp import CopyEngineUnavailable, PeerTimeoutError, make_transport

SPEC = {"hidden": (torch.bfloat16, (96,)), "stats": (torch.float32, (3, 4)), "ids": (torch.int64, ())}
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.int64: torch.int64}


def _device(kind):
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def _persistent(device, max_rows, poison=True, own_allocation=False):
    """``own_allocation`` (CUDA): in an allocation of their own, as depth=0 needs (``alloc_persistent``)."""
    if own_allocation and device.type == "cuda":
        from syncless.pp import alloc_persistent

        out = alloc_persistent({name: ((max_rows, *row), dtype) for name, (dtype, row) in SPEC.items()}, device)
    else:
        out = {name: torch.empty((max_rows, *row), dtype=dtype, device=device) for name, (dtype, row) in SPEC.items()}
    for t in out.values():
        _poison(t)
    return out


def _poison(t):
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(-7)


def _rows(seed, step, max_rows):
    rng = random.Random(seed * 1_000_003 + step)
    pick = rng.random()
    if pick < 0.1:
        return {name: 0 for name in SPEC}
    if pick < 0.2:
        return {name: max_rows for name in SPEC}
    return {name: rng.randint(0, max_rows) for name in SPEC}


def expected(seed, step, max_rows, device):
    """The step's data, reproducible on any rank: rows from a seeded RNG, values from a seeded generator."""
    rows = _rows(seed, step, max_rows)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 7919 + step)
    n = rows["hidden"]
    hidden = torch.randn((n, 96), generator=gen, device=device).to(torch.bfloat16)
    m = rows["stats"]
    if step % 5 == 0:  # a non-contiguous source on some steps
        stats = torch.randn((m, 4, 3), generator=gen, device=device).transpose(1, 2)
    else:
        stats = torch.randn((m, 3, 4), generator=gen, device=device)
    ids = torch.randint(-(2**40), 2**40, (rows["ids"],), generator=gen, device=device)
    return {"hidden": hidden, "stats": stats, "ids": ids}


def _mismatches(out, exp):
    total = None
    for name in SPEC:
        if out[name].shape != exp[name].shape:
            raise AssertionError(f"{name}: got shape {tuple(out[name].shape)}, expected {tuple(exp[name].shape)}")
        bits = BITS[exp[name].dtype]
        diff = (out[name].contiguous().view(bits) != exp[name].contiguous().view(bits)).sum()
        total = diff if total is None else total + diff
    return total


def _maybe_sleep(kind, rng, chance):
    if kind == "cuda" and rng.random() < chance:
        torch.cuda._sleep(rng.randint(20_000, 2_000_000))


#: GPU cycles of one stall (about 20 ms at H200 clocks): long enough for the sender to fill every slot.
STALL_CYCLES = 40_000_000


def bit_exact(
    rank, world, kind, steps, max_rows, backend, expect_backend, stage_ranks=None, seed=1234, timeout_s=60,
    depth=None, stall_every=0,
):
    """Stage 0 makes fresh data each step; every later stage checks it bit for bit, middle stages forward it.

    ``depth`` None uses make_transport's default. ``stall_every`` > 0 (CUDA
    only): before every such step the last stage holds its stream for a
    long kernel, so the sender runs into a full ring (back-pressure) and any
    slot reused too early shows up as a mismatch. With ``depth="auto"`` the
    hosts are paced (:func:`auto_host_pause`) so that steps go both ways.
    """
    device = _device(kind)
    order = list(stage_ranks) if stage_ranks else list(range(world))
    index = order.index(rank)
    first, last = index == 0, index == len(order) - 1
    persistent = None if first else _persistent(device, max_rows, own_allocation=depth in (0, "auto"))
    extra = {} if depth is None else {"depth": depth}
    transport = make_transport(
        None, persistent, stage_ranks=order, backend=backend, timeout_s=timeout_s, device=device, **extra
    )
    say(f"stage {index}: transport {transport.backend} (fallback: {transport.fallback_reason})")
    if transport.backend != expect_backend:
        raise AssertionError(f"expected the {expect_backend} transport, got {transport.backend}")
    if depth is not None and transport.backend == "copy_engine" and transport.depth != depth:
        raise AssertionError(f"expected depth {depth}, got {transport.depth}")
    rng = random.Random(seed + rank)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    src = _persistent(device, max_rows) if first else None
    for step in range(1, steps + 1):
        if first:
            exp = expected(seed, step, max_rows, device)
            tensors = {}
            for name, value in exp.items():
                if name == "stats" and step % 5 == 0:
                    tensors[name] = value  # already a non-contiguous view
                else:
                    src[name][: value.shape[0]].copy_(value)
                    tensors[name] = src[name][: value.shape[0]]
            _maybe_sleep(kind, rng, 0.05)
            if depth == "auto":
                auto_host_pause(step, sender=True)
            transport.send(tensors)
            for t in src.values():  # the caller reuses its buffers at once
                _poison(t)
            if step % 5 == 0:
                exp["stats"].fill_(float("nan"))
        else:
            for t in persistent.values():
                _poison(t)
            _maybe_sleep(kind, rng, 0.15)  # a long kernel before reading: back-pressure on the sender
            if last and stall_every and kind == "cuda" and step % stall_every == 0:
                torch.cuda._sleep(STALL_CYCLES)
            if depth == "auto":
                auto_host_pause(step, sender=False)
            out = transport.recv()
            bad += _mismatches(out, expected(seed, step, max_rows, device))
            if not last:
                transport.send(out)
        if step % 250 == 0 or step == steps:
            if not first and int(bad) != 0:
                raise AssertionError(f"stage {index}: {int(bad)} mismatching elements by step {step}")
            say(f"stage {index}: {step}/{steps} steps ok")
    if kind == "cuda":
        torch.cuda.synchronize()
    transport.close()
    result = {"backend": transport.backend, "mismatches": int(bad), "steps": steps}
    if first and transport.backend == "copy_engine":  # did its steps go out as one batched copy, as they should here?
        from syncless.pp import _driver

        result["batched_copies"] = transport.batched_copies
        result["batching_expected"] = _driver.batch_api_problem() is None
        result["direct_steps"] = transport.direct_steps_sent
        say(f"stage 0: {transport.direct_steps_sent} of {steps} steps went direct")
    return result


def auto_host_pause(step, sender):
    """Pace the hosts of a ``depth="auto"`` test so that both paths are taken.

    The sender's host sleeps 2 ms before every 4th step: the receiver's host, blocked in recv() for
    the metadata, has posted that step by then, so it goes direct. Right after it, the sender sends
    again at once, before the receiver's host posted: a slot step. The receiver's host sleeps 0.5 ms
    before every 8th step (a stage busy on its host), so the sender gets ahead at times too.
    """
    if sender and step % 4 == 0:
        time.sleep(0.002)
    elif not sender and step % 8 == 5:
        time.sleep(0.0005)


def _recv_must_raise(transport, failure):
    """Call ``recv()``, which must raise PeerTimeoutError (else AssertionError(failure)); return (seconds, message)."""
    start = time.monotonic()
    try:
        transport.recv()
    except PeerTimeoutError as err:
        waited = time.monotonic() - start
        say(f"recv raised after {waited:.1f} s: {err}")
        return waited, str(err)
    raise AssertionError(failure)


def stream_switching(rank, world, steps, depth=2, seed=4321, timeout_s=60):
    """Every send() and recv() runs on a stream picked at random, some held first by a long kernel.

    CUDA only, two stages. The sender makes each step's tensors on the stream
    it sends on and has no other ordering between those streams, so a step
    sent from an idle stream right after one sent from a busy stream would
    overtake it unless the transport keeps steps in order. The receiver
    orders its own streams (its check of step N reads the persistent tensors
    that step N+1 rewrites) and checks every step bit for bit.
    """
    device = _device("cuda")
    max_rows = 64
    persistent = None if rank == 0 else _persistent(device, max_rows, own_allocation=depth in (0, "auto"))
    transport = make_transport(
        None, persistent, backend="copy_engine", timeout_s=timeout_s, device=device, depth=depth
    )
    rng = random.Random(seed + rank)
    streams = [torch.cuda.default_stream(device), torch.cuda.Stream(device), torch.cuda.Stream(device)]
    checks = []
    previous = None
    for step in range(1, steps + 1):
        stream = rng.choice(streams)
        if rank == 1 and previous is not None and previous is not stream:
            stream.wait_stream(previous)
        with torch.cuda.stream(stream):
            if rng.random() < 0.3:
                torch.cuda._sleep(rng.randint(1, 20) * 100_000)  # up to about 1 ms
            if depth == "auto":
                auto_host_pause(step, sender=rank == 0)
            if rank == 0:
                transport.send(expected(seed, step, max_rows, device))
            else:
                checks.append(_mismatches(transport.recv(), expected(seed, step, max_rows, device)))
        previous = stream
        if step % 100 == 0:
            say(f"rank {rank}: {step}/{steps} steps enqueued")
    torch.cuda.synchronize()
    mismatches = sum(int(check) for check in checks)
    direct = transport.direct_steps_sent
    transport.close()
    if rank == 0:
        say(f"rank 0: {direct} of {steps} steps went direct")
        return {"direct_steps": direct, "steps": steps}
    return {"mismatches": mismatches, "steps": steps}


def validation(rank, world, kind, backend, other_device=None):
    """Bad steps raise ValueError/TypeError naming expected and got; the transport keeps working."""
    device = _device(kind)
    max_rows = 8
    transport = make_transport(None, None if rank == 0 else _persistent(device, max_rows), backend=backend, device=device)
    messages = []
    if rank == 0:
        good = expected(7, 1, max_rows, device)
        if sum(t.shape[0] for t in good.values()) == 0:
            raise AssertionError("seed gives an empty step")
        h = good["hidden"]
        cases = [
            ({"hidden": h, "bogus2": h}, ValueError, "unknown ['bogus2']"),  # a subset is fine, a stranger not
            ({**good, "bogus": h}, ValueError, "unknown ['bogus']"),
            ({**good, "hidden": h.float()}, ValueError, "expected dtype torch.bfloat16, got torch.float32"),
            ({**good, "hidden": torch.zeros((2, 95), dtype=torch.bfloat16, device=device)}, ValueError,
             "expected shape (rows, *(96,)), got (2, 95)"),
            ({**good, "ids": torch.zeros(max_rows + 1, dtype=torch.int64, device=device)}, ValueError,
             f"expected at most {max_rows} rows, got {max_rows + 1}"),
            ({**good, "ids": "not a tensor"}, TypeError, "['ids'] must be a torch.Tensor"),
        ]
        if kind == "cuda":
            cases.append(({**good, "hidden": h.cpu()}, ValueError, f"expected a tensor on {device}, got one on cpu"))
            if other_device is not None:
                elsewhere = torch.device("cuda", other_device)
                cases.append(({**good, "hidden": h.to(elsewhere)}, ValueError, f"got one on {elsewhere}"))
        else:
            cases.append(({**good, "hidden": h.to("meta")}, ValueError, "expected a tensor on cpu, got one on meta"))
        for step, err_type, words in cases:
            try:
                transport.send(step)
            except err_type as err:
                if words not in str(err):
                    raise AssertionError(f"message {str(err)!r} lacks {words!r}") from err
                messages.append(str(err))
            else:
                raise AssertionError(f"send() accepted a bad step ({words})")
        transport.send(good)
    else:
        out = transport.recv()
        if int(_mismatches(out, expected(7, 1, max_rows, device))) != 0:
            raise AssertionError("the good step after the bad ones arrived wrong")
    dist.barrier()
    transport.close()
    return messages


SUBSET_SPEC = {"hidden": (torch.bfloat16, (96,)), "ids": (torch.int64, ()), "z": (torch.complex64, (3,))}


def _subset_step(seed, step, max_rows, device):
    """A random subset of SUBSET_SPEC's keys (empty and full included) with random rows; every third step
    sends conjugate and negative views (whose raw bytes are not their values)."""
    rng = random.Random(seed * 7919 + step)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + step)
    pick = rng.random()
    names = [] if pick < 0.1 else list(SUBSET_SPEC) if pick < 0.2 else [n for n in SUBSET_SPEC if rng.random() < 0.5]
    out = {}
    for name in names:
        dtype, row = SUBSET_SPEC[name]
        shape = (rng.randint(0, max_rows), *row)
        if dtype == torch.int64:
            out[name] = torch.randint(-(2**40), 2**40, shape, generator=gen, device=device)
        else:
            out[name] = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype) \
                if dtype != torch.complex64 else torch.randn(shape, generator=gen, device=device, dtype=dtype)
    if step % 3 == 0:
        if "z" in out:
            out["z"] = out["z"].conj() if step % 2 else torch._neg_view(out["z"])
        if "hidden" in out:
            out["hidden"] = torch._neg_view(out["hidden"])
    return out


def _value_bytes(t):
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def subset_steps(rank, world, kind, backend, depth, steps, max_rows=16, seed=77, timeout_s=30):
    """Stage 0 sends random subsets of the keys (and conj/neg views); stage 1 must get exactly those keys,
    bit-exact; returns the count of wrong steps and of each kind of step seen."""
    device = _device(kind)
    persistent = None
    if rank == 1:
        shapes = {n: ((max_rows, *row), dtype) for n, (dtype, row) in SUBSET_SPEC.items()}
        if kind == "cuda" and depth in (0, "auto"):
            from syncless.pp import alloc_persistent

            persistent = alloc_persistent(shapes, device)
        else:
            persistent = {n: torch.empty(shape, dtype=dtype, device=device) for n, (shape, dtype) in shapes.items()}
    transport = make_transport(None, persistent, backend=backend, depth=depth, timeout_s=timeout_s, device=device)
    say(f"stage {rank}: {transport.backend} depth {depth!r}")
    wrong, partial, empty = 0, 0, 0
    for step in range(1, steps + 1):
        data = _subset_step(seed, step, max_rows, device)
        if rank == 0:
            transport.send(data)
            continue
        for t in persistent.values():
            t.view(torch.uint8).fill_(0xA5)
        out = transport.recv()
        if sorted(out) != sorted(data) or any(
            out[n].shape != data[n].shape or not torch.equal(_value_bytes(out[n]), _value_bytes(data[n])) for n in data
        ):
            wrong += 1
        partial += 0 < len(data) < len(SUBSET_SPEC)
        empty += not data
        if step % 50 == 0 or step == steps:
            say(f"stage 1: {step}/{steps} steps, {wrong} wrong")
    if kind == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    transport.close()
    return {"backend": transport.backend, "wrong": wrong, "partial": partial, "empty": empty, "steps": steps}


def depth_checks(rank, world, kind):
    """Bad or mismatched depths raise the same ValueError on every rank; a good depth then works."""
    device = _device(kind)
    max_rows = 8
    messages = []
    cases = [
        ({0: 2, 1: 0}, "stage 1 (rank 1)"),
        ({0: True, 1: 2}, "stage 0 (rank 0)"),
        ({0: 2, 1: "2"}, "stage 1 (rank 1)"),
        ({0: 2, 1: 3}, "stage 0 (rank 0): 2, stage 1 (rank 1): 3"),
    ]
    for depths, words in cases:
        persistent = None if rank == 0 else _persistent(device, max_rows)
        try:
            make_transport(None, persistent, backend="torch_distributed", device=device, depth=depths[rank])
        except ValueError as err:
            if words not in str(err) or "depth" not in str(err):
                raise AssertionError(f"message {str(err)!r} lacks {words!r} or 'depth'") from err
            messages.append(str(err))
        else:
            raise AssertionError(f"make_transport accepted depths {depths}")
    transport = make_transport(
        None, None if rank == 0 else _persistent(device, max_rows), backend="torch_distributed", device=device, depth=3
    )
    for step in range(1, 6):
        if rank == 0:
            transport.send(expected(13, step, max_rows, device))
        elif int(_mismatches(transport.recv(), expected(13, step, max_rows, device))) != 0:
            raise AssertionError("depth=3 delivered wrong data")
    dist.barrier()
    transport.close()
    return messages


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def uniform_failure(rank, world, kind, inject_rank, inject, region_rows):
    """One rank's set-up fails: every rank raises the same error, frees everything, and auto falls back once."""
    from syncless.pp._driver import live_resources

    device = _device(kind)
    persistent = None if rank == 0 else _persistent(device, region_rows)
    counter = _Count()
    logging.getLogger("syncless.pp").addHandler(counter)
    inject_here = inject if rank == inject_rank else None

    def free_bytes():
        if kind != "cuda":
            return 0
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info(device)[0]

    if kind == "cuda":  # warm the driver's IPC and peer machinery so the baseline is steady
        make_transport(None, persistent, backend="copy_engine", device=device).close()
    dist.barrier()
    baseline = free_bytes()
    dist.barrier()
    try:
        make_transport(None, persistent, backend="copy_engine", device=device, _inject_failure=inject_here)
    except CopyEngineUnavailable as err:
        message = str(err)
    else:
        raise AssertionError("copy-engine set-up succeeded although one rank failed")
    dist.barrier()
    after = free_bytes()
    leaks = live_resources()
    if leaks:
        raise AssertionError(f"resources still held after the failed set-up: {leaks}")
    if kind == "cuda" and abs(after - baseline) >= 2 << 20:
        raise AssertionError(f"device memory did not return to baseline: {baseline} -> {after} free bytes")
    say(f"failed uniformly: {message}")
    transports = [
        make_transport(None, persistent, backend=None, device=device, _inject_failure=inject_here) for _ in range(2)
    ]
    for transport in transports:
        if transport.backend != "torch_distributed" or transport.fallback_reason != message:
            raise AssertionError(f"fallback not as expected: {transport.backend}, {transport.fallback_reason!r}")
    logged = [m for m in counter.messages if message in m]
    if len(logged) != 1:
        raise AssertionError(f"the fallback reason was logged {len(logged)} times: {counter.messages}")
    fallback = transports[1]
    for step in range(1, 4):
        if rank == 0:
            fallback.send(expected(11, step, region_rows, device))
        elif int(_mismatches(fallback.recv(), expected(11, step, region_rows, device))) != 0:
            raise AssertionError("the fallback transport delivered wrong data")
    dist.barrier()
    for transport in transports:
        transport.close()
    return message


def peer_death(rank, world, kind, backend, timeout_s, steps_before=20):
    """The sender is killed after some steps; the receiver's next recv raises PeerTimeoutError in time."""
    device = _device(kind)
    max_rows = 16
    transport = make_transport(
        None, None if rank == 0 else _persistent(device, max_rows), backend=backend, timeout_s=timeout_s, device=device
    )
    for step in range(1, steps_before + 1):
        if rank == 0:
            transport.send(expected(5, step, max_rows, device))
        elif int(_mismatches(transport.recv(), expected(5, step, max_rows, device))) != 0:
            raise AssertionError("data wrong before the peer died")
    if kind == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        say("killing myself (the sender)")
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    waited, _ = _recv_must_raise(transport, "recv() returned although the sender is dead")
    _recv_must_raise(transport, "the transport kept working after its peer died")
    start_close = time.monotonic()
    transport.close()
    say(f"close() took {time.monotonic() - start_close:.1f} s")
    return waited


def stopped_sending(rank, world, kind, backend, timeout_s):
    """The sender stays alive but sends nothing: the receiver raises PeerTimeoutError after the timeout."""
    device = _device(kind)
    max_rows = 4
    transport = make_transport(
        None, None if rank == 0 else _persistent(device, max_rows), backend=backend, timeout_s=timeout_s, device=device
    )
    waited = None
    if rank == 0:
        transport.send(expected(3, 1, max_rows, device))
    else:
        transport.recv()
        waited, _ = _recv_must_raise(transport, "recv() returned although nothing was sent")
    dist.barrier()
    transport.close()
    return waited


def gpu_stall(rank, world, timeout_s):
    """Metadata arrives but the sender's GPU is stuck: the receiver's GPU wait is released and the next call raises."""
    device = _device("cuda")
    max_rows = 8
    persistent = None if rank == 0 else _persistent(device, max_rows)
    transport = make_transport(None, persistent, backend="copy_engine", timeout_s=timeout_s, device=device)
    result = {}
    if rank == 0:
        transport.send(expected(9, 1, max_rows, device))
        # Hold the sender's current stream (its peer copies wait behind it) for about three timeouts.
        torch.cuda._sleep(int(3 * timeout_s * 2.0e9))
        transport.send(_full_step(device, max_rows))
        # The step's relay waited for that sleep, which is the caller's own work: the sender's watchdog
        # must not count it as the peer's delay.
        torch.cuda.synchronize()
        result["sender_failure"] = None if transport._failure is None else repr(transport._failure)
    else:
        if int(_mismatches(transport.recv(), expected(9, 1, max_rows, device))) != 0:
            raise AssertionError("step 1 wrong")
        out = transport.recv()  # metadata arrives at once; the data never does in time
        start = time.monotonic()
        torch.cuda.synchronize()  # must come back once the watchdog releases the wait
        result["synchronize_s"] = time.monotonic() - start
        result["ids_poisoned"] = bool((out["ids"] == -1).all())
        _, result["error"] = _recv_must_raise(transport, "recv() after a released wait did not raise")
    torch.cuda.synchronize()
    dist.barrier()
    transport.close()
    return result


def one_hardware_queue(rank, world):
    """Under CUDA_DEVICE_MAX_CONNECTIONS=1: "copy_engine" raises on every stage, "auto" falls back and works."""
    device = _device("cuda")
    max_rows = 8
    persistent = None if rank == 0 else _persistent(device, max_rows)
    result = {}
    try:
        make_transport(None, persistent, backend="copy_engine", timeout_s=20.0, device=device)
        result["refused"] = "nothing was raised"
    except CopyEngineUnavailable as err:
        result["refused"] = str(err)
    say(f"backend='copy_engine': {result['refused'][:160]}")
    transport = make_transport(None, persistent, backend="auto", timeout_s=20.0, device=device)
    result["backend"], result["fallback_reason"] = transport.backend, transport.fallback_reason or ""
    say(f"backend='auto' gave {transport.backend}")
    bad = 0
    for step in range(1, 21):
        if rank == 0:
            transport.send(expected(31, step, max_rows, device))
        else:
            bad += int(_mismatches(transport.recv(), expected(31, step, max_rows, device)))
    torch.cuda.synchronize()
    transport.close()
    result["mismatches"] = bad
    return result


def _full_step(device, max_rows):
    """A step with every row filled with fresh random values."""
    return {
        "hidden": torch.randn((max_rows, 96), device=device).to(torch.bfloat16),
        "stats": torch.randn((max_rows, 3, 4), device=device),
        "ids": torch.randint(0, 2**40, (max_rows,), device=device),
    }


def bounded_sends(rank: int, world_size: int, steps: int) -> int:
    """Send ``steps`` small steps while the receiver lags behind; return the most sends ever pending."""
    import torch

    from syncless.pp import make_transport

    persistent = None if rank == 0 else {"x": torch.empty(4, 3)}
    transport = make_transport(None, persistent, backend="torch_distributed", device=torch.device("cpu"))
    most = 0
    for step in range(steps):
        if rank == 0:
            transport.send({"x": torch.full((4, 3), float(step))})
            most = max(most, len(transport._pending))
        else:
            got = transport.recv()["x"]
            if not torch.equal(got, torch.full((4, 3), float(step))):
                raise AssertionError(f"step {step}: got {got}")
    transport.close()
    return most


def graph_capture_refused(rank, world, backend):
    """send()/recv() under CUDA graph capture raise TransportError before touching anything; steps go on after."""
    from syncless.pp import TransportError

    device = _device("cuda")
    max_rows = 8
    transport = make_transport(None, None if rank == 0 else _persistent(device, max_rows), backend=backend,
                               device=device, timeout_s=30)
    messages = []
    for step in range(1, 7):
        if step == 4:  # between steps 3 and 4, each stage tries its call inside a capture
            torch.cuda.synchronize()
            time.sleep(0.2)  # the watchdog has seen every bracket finish: nothing of ours runs during capture
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(device)
            data = expected(21, step, max_rows, device)  # made outside the capture
            try:
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    if rank == 0:
                        transport.send(data)
                    else:
                        transport.recv()
            except TransportError as err:
                messages.append(str(err))
            else:
                raise AssertionError("a call under graph capture was accepted")
        if rank == 0:
            transport.send(expected(21, step, max_rows, device))
        elif int(_mismatches(transport.recv(), expected(21, step, max_rows, device))) != 0:
            raise AssertionError(f"step {step} arrived wrong after the refused capture")
    torch.cuda.synchronize()
    dist.barrier()
    transport.close()
    if transport.error is not None:
        raise AssertionError(f"the refusal broke the transport: {transport.error!r}")
    return messages


def abort_and_drop(rank, world, timeout_s=20.0):
    """abort() from another thread ends a blocked recv() at once and keeps the buffer; a dropped transport is freed.

    Two stages (any GPUs). Returns what each stage saw.
    """
    import gc
    import threading
    import weakref

    from syncless.pp import TransportError, TransportFailedError
    from syncless.pp._driver import live_resources

    device = _device("cuda")
    max_rows = 8
    result = {}
    persistent = None if rank == 0 else _persistent(device, max_rows)
    transport = make_transport(None, persistent, backend="copy_engine", device=device, timeout_s=timeout_s)
    for step in range(1, 4):
        if rank == 0:
            transport.send(expected(31, step, max_rows, device))
        elif int(_mismatches(transport.recv(), expected(31, step, max_rows, device))) != 0:
            raise AssertionError(f"step {step} wrong")
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        # Nothing more is sent: recv() blocks in the metadata socket until abort() on another thread.
        threading.Timer(0.5, transport.abort).start()
        start = time.monotonic()
        try:
            transport.recv()
        except TransportError as err:
            result["recv_s"] = time.monotonic() - start
            result["recv_error"] = type(err).__name__
        else:
            raise AssertionError("recv() returned after abort()")
        result["error"] = type(transport.error).__name__
        start = time.monotonic()
        transport.close()  # finishes what abort() left to the running recv(); no barrier
        result["close_s"] = time.monotonic() - start
        result["leaked_nbytes"] = transport.leaked_nbytes
        try:
            transport.recv()
        except TransportFailedError:
            result["raises_after"] = True
    dist.barrier()
    if rank == 0:  # only now: closing its socket earlier would end the receiver's recv() before abort() does
        result["leaked_nbytes"] = transport.abort()  # its peer aborted: no barrier would pair up
    dist.barrier()
    del transport
    gc.collect()
    # A transport dropped without close(): collected, its watchdog thread ends, what is local is released.
    before = live_resources()
    dropped = make_transport(None, persistent, backend="copy_engine", device=device, timeout_s=timeout_s)
    for step in range(1, 4):
        if rank == 0:
            dropped.send(expected(32, step, max_rows, device))
        elif int(_mismatches(dropped.recv(), expected(32, step, max_rows, device))) != 0:
            raise AssertionError(f"step {step} wrong")
    torch.cuda.synchronize()
    dist.barrier()
    gone = weakref.ref(dropped)
    del dropped
    gc.collect()
    result["collected"] = gone() is None
    deadline = time.monotonic() + 5
    while any(t.name == "syncless-pp-watchdog" and t.is_alive() for t in threading.enumerate()):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    result["watchdogs_alive"] = sum(t.name == "syncless-pp-watchdog" and t.is_alive() for t in threading.enumerate())
    after = live_resources()
    # Streams, events and mappings are back where they were; the buffer (and the context retain that
    # keeps it) stay, by design: without a barrier no stage knows whether its peer still maps them.
    result["local_released"] = all(after.get(kind, 0) == before.get(kind, 0) for kind in ("stream", "event",
                                                                                        "ipc_mapping"))
    result["kept"] = {kind: after.get(kind, 0) - before.get(kind, 0) for kind in ("allocation", "context")}
    dist.barrier()
    return result


def fallback_after_a_leaky_set_up(rank, world, kind, region_rows):
    """A copy-engine set-up that failed after sharing its buffer: the fallback reports the bytes it kept.

    The copy-engine set-up is replaced by one that fails the way a broken exchange does (the error carries
    ``leaked_nbytes``); ``auto`` then falls back, and the fallback's ``leaked_nbytes`` and ``abort()`` say it.
    """
    from syncless._core.errors import CopyEngineUnavailable
    from syncless.pp import _make

    device = _device(kind)
    persistent = None if rank == 0 else _persistent(device, region_rows)

    def leaky_set_up(**kwargs):
        err = CopyEngineUnavailable("stage 1 sent nothing within 1 s (test)")
        err.leaked_nbytes = 2 << 20
        raise err

    _make.open_copy_engine = leaky_set_up
    transport = make_transport(None, persistent, backend=None, device=device)
    result = {"backend": transport.backend, "leaked_nbytes": transport.leaked_nbytes}
    result["abort"] = transport.abort()
    return result


def attributes(rank, world, depths, names):
    """For each depth, build the CPU transport (torch.distributed, what ``backend="auto"`` gives here) and
    read every name; one result per depth."""
    results = []
    for depth in depths:
        transport = make_transport(None, None if rank == 0 else _persistent(torch.device("cpu"), 4), depth=depth,
                                   timeout_s=20, device="cpu")  # the first stage's default is CUDA where there is one
        say(f"stage {rank}: {transport.backend} at depth {depth!r}, reading {len(names)} attributes")
        values = {}
        for name in names:
            value = getattr(transport, name)  # AttributeError here is the bug under test
            values[name] = "callable" if callable(value) else value
        dist.barrier()
        transport.close()
        results.append({"class": type(transport).__name__, **values})
    return results


def _refused(build, expect_type, words):
    """Run ``build()``; return its error's message after checking its type, words and that it came at once."""
    start = time.monotonic()
    try:
        build()
    except expect_type as err:
        took = time.monotonic() - start
        if words not in str(err):
            raise AssertionError(f"message {str(err)!r} lacks {words!r}") from err
        if took > 3.0:
            raise AssertionError(f"the refusal took {took:.1f} s (a peer timeout, not an agreed refusal?)") from err
        return str(err)
    raise AssertionError(f"make_transport accepted it ({words})")


def mismatched_arguments(rank, world):
    """Stages passing different arguments, or a malformed ``persistent``: the same clear error on every stage,
    at once; a correct make_transport on the same group then works. Returns every message, in order."""
    from syncless.pp import _make

    cpu = torch.device("cpu")
    max_rows = 8

    def persistent():
        return None if rank == 0 else _persistent(cpu, max_rows)

    def build(**kwargs):
        return lambda: make_transport(None, persistent(), **{"timeout_s": 20, "device": cpu, **kwargs})

    messages = []
    say(f"rank {rank}: backend")
    messages.append(_refused(build(backend="auto" if rank == 0 else "torch_distributed"), ValueError,
                             "every stage must pass the same backend (or SYNCLESS_PP_TRANSPORT); got stage 0 "
                             "(rank 0): 'auto', stage 1 (rank 1): 'torch_distributed'"))
    say(f"rank {rank}: SYNCLESS_PP_TRANSPORT")
    os.environ["SYNCLESS_PP_TRANSPORT"] = "torch_distributed" if rank == 0 else "auto"
    try:
        messages.append(_refused(build(), ValueError, "same backend (or SYNCLESS_PP_TRANSPORT)"))
    finally:
        del os.environ["SYNCLESS_PP_TRANSPORT"]
    say(f"rank {rank}: stage_ranks")
    messages.append(_refused(build(stage_ranks=[0, 1] if rank == 0 else [1, 0]), ValueError,
                             "same stage_ranks; got rank 0: (0, 1), rank 1: (1, 0)"))
    say(f"rank {rank}: depth")
    messages.append(_refused(build(depth=2 if rank == 0 else "auto"), ValueError, "same depth"))
    say(f"rank {rank}: data backend")
    if rank == 1:  # a stage whose persistent tensors are on CUDA over an NCCL group (faked: no GPU here)
        real = (_make._resolve_device, _make.backend_for)
        _make._resolve_device = lambda persistent, device: torch.device("cuda", 0)
        _make.backend_for = lambda group, device_type: "nccl"
    try:
        messages.append(_refused(build(), ValueError, "same data backend; got stage 0 (rank 0): 'gloo', "
                                                      "stage 1 (rank 1): 'nccl' (the device types are stage 0 "
                                                      "(rank 0): cpu, stage 1 (rank 1): cuda)"))
    finally:
        if rank == 1:
            _make._resolve_device, _make.backend_for = real
    for bad, expect_type, words in [
        ([torch.zeros(max_rows, 8)], TypeError, "persistent must be a dict of name -> Tensor (or None); got list"),
        ({"hidden": 3}, TypeError, "persistent['hidden'] must be a torch.Tensor; got int"),
        ({"hidden": torch.zeros(())}, ValueError, "persistent['hidden'] needs a leading rows dimension"),
        ({7: torch.zeros(max_rows, 8)}, TypeError, "persistent keys must be str; got 7 (int)"),
    ]:
        say(f"rank {rank}: persistent={bad!r:.40}")
        messages.append(_refused(lambda bad=bad: make_transport(None, bad if rank == 1 else None, timeout_s=20,
                                                                device=cpu),
                                 expect_type, words))
    say(f"rank {rank}: a correct rebuild on the same group")
    transport = make_transport(None, persistent(), timeout_s=20, device=cpu)
    for step in range(1, 21):
        if rank == 0:
            transport.send(expected(17, step, max_rows, cpu))
        elif int(_mismatches(transport.recv(), expected(17, step, max_rows, cpu))) != 0:
            raise AssertionError(f"step {step} of the rebuilt transport arrived wrong")
    dist.barrier()
    transport.close()
    say(f"rank {rank}: 20 steps ok")
    return messages


def _threads_and_fds():
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def rebuild_rounds(rank, world, rounds):
    """``rounds`` rounds of make_transport / send / recv / close; the OS threads and open files before the
    second round and after the last (the first round warms up the world group's own connections)."""
    import gc

    cpu = torch.device("cpu")
    seen = []
    for round_ in range(rounds):
        transport = make_transport(None, None if rank == 0 else _persistent(cpu, 4), backend="torch_distributed",
                                   timeout_s=20, device=cpu)
        if rank == 0:
            transport.send(expected(3, 1, 4, cpu))
        elif int(_mismatches(transport.recv(), expected(3, 1, 4, cpu))) != 0:
            raise AssertionError(f"round {round_}: the step arrived wrong")
        dist.barrier()
        transport.close()
        del transport
        if round_ in (0, rounds - 1):
            gc.collect()
            seen.append(_threads_and_fds())
        if round_ % 20 == 0:
            say(f"rank {rank}: round {round_}/{rounds}, threads and fds {_threads_and_fds()}")
    dist.barrier()
    return seen


def peer_never_arrives(rank, world, timeout_s):
    """Rank 1 leaves without calling make_transport; rank 0's make_transport must raise PeerTimeoutError
    within timeout + 2 s. Returns (error type, message, seconds) on rank 0."""
    if rank == 1:
        say("rank 1: leaving without make_transport")
        return None
    start = time.monotonic()
    try:
        make_transport(None, None, backend="torch_distributed", timeout_s=timeout_s, device="cpu")
    except Exception as err:  # noqa: BLE001 - reported to the parent, which asserts on the type
        took = time.monotonic() - start
        say(f"rank 0: {type(err).__name__} after {took:.2f} s")
        return type(err).__name__, isinstance(err, PeerTimeoutError), str(err), took
    raise AssertionError("make_transport built a transport without its peer")


def deferred_recv(rank, world, kind, backend, depth, steps, max_rows=16, timeout_s=30):
    """recv(wait=False): keys at once, data at first use (on the current stream), bit-exact; a step never
    used is finished by the next recv() (and the last one by close()). Returns counts."""
    device = _device(kind)
    persistent = None
    if rank == 1:
        persistent = _persistent(device, max_rows, own_allocation=depth in (0, "auto"))
    transport = make_transport(None, persistent, backend=backend, depth=depth, timeout_s=timeout_s, device=device)
    checked = unused = 0
    for step in range(1, steps + 1):
        data = expected(21, step, max_rows, device)
        if rank == 0:
            transport.send(data)
            continue
        out = transport.recv(wait=False)
        if out.waited or sorted(out) != sorted(data) or len(out) != len(data) or "bogus" in out:
            raise AssertionError(f"step {step}: {out!r} before first use")
        if step % 4 == 0 or step == steps:
            unused += 1
            continue
        if int(_mismatches(dict(out.items()), data)) != 0:
            raise AssertionError(f"step {step} arrived wrong")
        checked += 1
        if step % 50 == 0:
            say(f"stage 1: {step}/{steps}")
    if kind == "cuda":
        torch.cuda.synchronize()
    transport.close()  # finishes the last, unused step
    dist.barrier()
    return {"backend": transport.backend, "checked": checked, "unused": unused}


#: The deferred-wait measurement: 256 MiB per step (a transfer of a few hundred microseconds on one GPU, most
#: of it still running when the receiver's recv() returns), and input preparation of about that length.
DEFER_ROWS, DEFER_WIDTH = 16384, 8192  # bf16: 256 MiB
DEFER_PREP_CYCLES = 600_000  # ~0.3 ms at H200 clocks


def deferred_wait_timing(rank, world, depth, steps=30):
    """Two stages on one GPU; per step, both start together (host barrier, idle GPU). The receiver records
    an event, calls recv() (or recv(wait=False)), queues input preparation (a sleep kernel), then a reader
    of the data, and records an event: the GPU time between them, and the host time recv() took, in each
    mode. Returns the medians (us) and the mismatches of the data read."""
    import statistics

    device = _device("cuda")
    shape = (DEFER_ROWS, DEFER_WIDTH)
    persistent = None
    if rank == 1:
        from syncless.pp import alloc_persistent

        persistent = alloc_persistent({"hidden": (shape, torch.bfloat16)}, device) if depth in (0, "auto") else {
            "hidden": torch.empty(shape, dtype=torch.bfloat16, device=device)}
    transport = make_transport(None, persistent, backend="copy_engine", depth=depth, timeout_s=30, device=device)
    source = torch.randn(shape, device=device).to(torch.bfloat16) if rank == 0 else None
    result = {"depth": depth}
    bad = torch.zeros((), dtype=torch.int64, device=device)
    for mode in ("recv()", "recv(wait=False)", "recv()", "recv(wait=False)"):  # twice each: the first warms up
        gpu_us, host_us = [], []
        for step in range(steps):
            torch.cuda.synchronize()
            dist.barrier()
            if rank == 0:
                source[:1].fill_(step)  # each step's data differs
                transport.send({"hidden": source})
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            out = transport.recv() if mode == "recv()" else transport.recv(wait=False)
            host_us.append((time.perf_counter() - t0) * 1e6)
            torch.cuda._sleep(DEFER_PREP_CYCLES)  # input preparation, between recv() and first use
            first_row = out["hidden"][:1]
            bad += (first_row.float() != float(step)).sum()  # bf16 holds these small integers exactly
            end.record()
            end.synchronize()
            gpu_us.append(start.elapsed_time(end) * 1e3)
        if rank == 1:
            result[mode] = {"gpu_us": round(statistics.median(gpu_us), 1),
                            "host_us": round(statistics.median(host_us), 1)}
            say(f"depth {depth!r} {mode}: GPU {result[mode]['gpu_us']} us from recv() to the reader's end, "
                f"host {result[mode]['host_us']} us in recv() (medians of {steps})")
    torch.cuda.synchronize()
    dist.barrier()
    transport.close()
    if rank == 1:
        # Alone: the preparation, and the transfer (a plain step with no preparation), for scale.
        prep_start, prep_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        prep_start.record()
        torch.cuda._sleep(DEFER_PREP_CYCLES)
        prep_end.record()
        prep_end.synchronize()
        result["prep_alone_us"] = round(prep_start.elapsed_time(prep_end) * 1e3, 1)
        say(f"input preparation alone: {result['prep_alone_us']} us")
    result["mismatches"] = int(bad)
    return result


def views_are_overwritten(rank, world):
    """The lifetime docs/pp.md states: a received view is the persistent tensor, rewritten by the next step."""
    cpu = torch.device("cpu")
    transport = make_transport(None, None if rank == 0 else {"h": torch.zeros(4, 2)}, timeout_s=20, device=cpu)
    if rank == 0:
        transport.send({"h": torch.full((3, 2), 1.0)})
        transport.send({"h": torch.full((3, 2), 2.0)})
        result = None
    else:
        first = transport.recv()["h"]
        kept = first.clone()  # what an async scheduler keeps
        before = (first.data_ptr(), first[0, 0].item())
        second = transport.recv()["h"]
        result = {"before": before[1], "after": first[0, 0].item(), "same_memory": second.data_ptr() == before[0],
                  "kept": kept[0, 0].item()}
    dist.barrier()
    transport.close()
    return result

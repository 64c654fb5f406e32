"""How far a readback whose job runs on a thread that never takes the GIL gets the host-bound loop (a probe, not a test).

Run on a GPU from the source tree::

    PYTHONPATH=src python3 tests/gpu/cc/probe_forked_readback.py [--steps 400] [--rounds 5]

Issue 33's two missed goals need a readback that does not wait on the loop's thread (the transfer floor already
misses the host-bound goal) and whose job does not take the GIL back while the loop runs Python (each take is a
switch: the worker thread's cost). No compiled extension may run that job; this probe asks whether TorchScript's
inter-op thread pool can: a scripted function called on the loop's thread enqueues the snapshot (a device copy of
the token on the D2H stream) and its ready event, then ``torch.jit.fork`` hands the job (wait for the event on a
copy stream, copy the snapshot to pinned memory, and the wait CC makes) to an inter-op thread, which runs
TorchScript and never takes the GIL. The consumer waits for the job's future (the GIL released), then the event.

No syncless code runs here: every setup is plain torch, so each figure is a ceiling for what a shim built this
way could reach (its own checks and bookkeeping come on top). Setups, rounds interleaved, in the bench's
host-bound loop (:func:`syncless.bench._cc_hostbound.decode_loop`'s steps) and in its one-step readback:

- ``plain``: torch alone, no CC;
- ``floor``: plain, and after each readback the wait CC makes the calling thread pay for the transfer;
- ``forked``: the readback's job on an inter-op thread as above, emulating CC's wait there.

Every token each setup reads is checked against plain's. Prints tokens/s per round and the ratios to plain in the
same round, the readback's host time (median us) per setup, and the scripted call's own cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from syncless.bench import _cc_hostbound as hb


@torch.jit.script
def _copy_job(snap: torch.Tensor, dst: torch.Tensor, ready: torch.classes.cuda.Event,
              copy_stream: torch.classes.cuda.Stream, device: int, emulate_cc: bool) -> int:
    """On an inter-op thread: the snapshot to pinned ``dst`` on ``copy_stream`` after ``ready``; under emulated CC
    the wait CC makes (the thread's own, the GIL not held)."""
    previous = torch.cuda.current_stream(device)
    torch.cuda.set_stream(copy_stream)
    copy_stream.wait_event(ready)
    dst.copy_(snap, non_blocking=True)
    if emulate_cc:
        copy_stream.synchronize()
    torch.cuda.set_stream(previous)
    return 0


@torch.jit.script
def _fork_readback(src: torch.Tensor, snap: torch.Tensor, dst: torch.Tensor, ready: torch.classes.cuda.Event,
                   copy_stream: torch.classes.cuda.Stream, device: int, emulate_cc: bool) -> torch.jit.Future[int]:
    """On the caller's thread: the snapshot and its event on the current stream, then the job forked."""
    current = torch.cuda.current_stream(device)
    snap.copy_(src, non_blocking=True)
    ready.record(current)
    return torch.jit.fork(_copy_job, snap, dst, ready, copy_stream, device, emulate_cc)


@torch.jit.script
def _empty_call(src: torch.Tensor) -> int:
    return 0


@torch.jit.script
def _snapshot_only(src: torch.Tensor, snap: torch.Tensor, ready: torch.classes.cuda.Event, device: int) -> int:
    current = torch.cuda.current_stream(device)
    snap.copy_(src, non_blocking=True)
    ready.record(current)
    return 0


@torch.jit.script
def _script_stream(device: torch.device) -> torch.classes.cuda.Stream:
    return torch.classes.cuda.Stream(device, 0)


@torch.jit.script
def _script_event() -> torch.classes.cuda.Event:
    return torch.classes.cuda.Event(False, False, False)


class Forked:
    """The per-D2H-stream state a shim would keep: a copy stream, and rings of snapshots and events."""

    def __init__(self, dev: torch.device, nbytes_like: torch.Tensor, ring: int = 4):
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.index = index
        self.copy_stream = _script_stream(torch.device("cuda", index))
        self.snaps = [torch.empty_like(nbytes_like) for _ in range(ring)]
        self.events = [_script_event() for _ in range(ring)]
        self.turn = 0

    def readback(self, src: torch.Tensor) -> tuple:
        """``src`` read back without waiting: (pinned result, future of its job)."""
        turn = self.turn = (self.turn + 1) % len(self.snaps)
        dst = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, pin_memory=True)
        future = _fork_readback(src, self.snaps[turn], dst, self.events[turn], self.copy_stream, self.index, True)
        return dst, future


def decode_loop(dev, step, d2h, steps, warmup, setup, tokens):
    """The bench's host-bound loop (:func:`._cc_hostbound.decode_loop`) with the readback of ``setup``."""
    current = torch.cuda.current_stream(dev)
    wait = hb.transfer_wait(d2h) if setup == "floor" else None
    forked = Forked(dev, step.token) if setup == "forked" else None
    ring = [torch.zeros(1, dtype=torch.int64, pin_memory=True) for _ in range(4)]
    pending = None
    start_s = 0.0
    for index in range(warmup + steps):
        if index == warmup:
            start_s = time.perf_counter()
        pos_host = ring[index % 4]
        pos_host[0] = index
        pos = pos_host.to(dev, non_blocking=True)
        step.pos.copy_(pos)
        step.graph.replay()
        for _ in range(hb.EAGER_LAUNCHES):
            step.scratch.add_(1.0)
        d2h.wait_stream(current)
        with torch.cuda.stream(d2h):
            if forked is None:
                token_host = step.token.to("cpu", non_blocking=True)
                job = None
            else:
                token_host, job = forked.readback(step.token)
            if wait is not None:
                wait()
            ready = torch.cuda.Event()
            ready.record(d2h)
        if pending is not None:
            if pending[2] is not None:
                pending[2].wait()
            pending[1].synchronize()
            tokens.append(int(pending[0][0]))
        pending = (token_host, ready, job)
    if pending[2] is not None:
        pending[2].wait()
    pending[1].synchronize()
    tokens.append(int(pending[0][0]))
    torch.cuda.synchronize(dev)
    return steps / (time.perf_counter() - start_s)


def readback_samples(dev, d2h, steps, setup):
    """Host time (us) of one step's readback (8 int64, an event, read one step late), as the bench's row."""
    current = torch.cuda.current_stream(dev)
    wait = hb.transfer_wait(d2h) if setup == "floor" else None
    tokens = torch.zeros(8, dtype=torch.int64, device=dev)
    forked = Forked(dev, tokens) if setup == "forked" else None
    pending = None
    times = []
    for index in range(steps + 10):
        tokens.add_(1)
        d2h.wait_stream(current)
        t0 = time.perf_counter()
        with torch.cuda.stream(d2h):
            if forked is None:
                host, job = tokens.to("cpu", non_blocking=True), None
            else:
                host, job = forked.readback(tokens)
            if wait is not None:
                wait()
            ready = torch.cuda.Event()
            ready.record(d2h)
        spent = time.perf_counter() - t0
        if pending is not None:
            t1 = time.perf_counter()
            if pending[2] is not None:
                pending[2].wait()
            pending[1].synchronize()
            spent += time.perf_counter() - t1
            if int(pending[0][0]) != index or not bool((pending[0] == index).all()):
                raise RuntimeError(f"{setup} readback step {index}: read {pending[0].tolist()}, expected {index}")
        if index >= 10:
            times.append(spent * 1e6)
        pending = (host, ready, job)
    if pending[2] is not None:
        pending[2].wait()
    pending[1].synchronize()
    return times


def call_costs(dev, d2h, count=2000):
    """Median host us of the scripted call alone, and of waiting for a finished job's future."""
    tokens = torch.zeros(8, dtype=torch.int64, device=dev)
    forked = Forked(dev, tokens)
    calls, waits = [], []
    with torch.cuda.stream(d2h):
        for _ in range(count):
            dst = torch.empty(8, dtype=torch.int64, pin_memory=True)
            turn = forked.turn = (forked.turn + 1) % 4
            t0 = time.perf_counter()
            future = _fork_readback(tokens, forked.snaps[turn], dst, forked.events[turn], forked.copy_stream,
                                    forked.index, True)
            calls.append((time.perf_counter() - t0) * 1e6)
            while not future.done():
                pass
            t1 = time.perf_counter()
            future.wait()
            waits.append((time.perf_counter() - t1) * 1e6)
    return statistics.median(calls), statistics.median(waits)


def call_breakdown(dev, d2h, count=2000):
    """Median host us per call of: an empty scripted function, the snapshot and record alone (scripted), the same
    in eager torch, and the whole scripted readback (the job forked), each with the job given 200 us to finish
    between calls; with the executor's optimizations on and off."""
    tokens = torch.zeros(8, dtype=torch.int64, device=dev)
    forked = Forked(dev, tokens)
    eager_event = torch.cuda.Event()
    out = {}

    def timed(name, call):
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            result = call()
            times.append((time.perf_counter() - t0) * 1e6)
            if isinstance(result, torch.jit.Future):
                result.wait()
            end = time.perf_counter() + 200e-6
            while time.perf_counter() < end:
                pass
        out[name] = statistics.median(times)

    with torch.cuda.stream(d2h):
        for optimize in (True, False):
            with torch.jit.optimized_execution(optimize):
                tag = "optimized" if optimize else "unoptimized"
                timed(f"empty scripted call, {tag}", lambda: _empty_call(tokens))
                timed(f"scripted snapshot + record, {tag}",
                      lambda: _snapshot_only(tokens, forked.snaps[0], forked.events[0], forked.index))
                dst = torch.empty(8, dtype=torch.int64, pin_memory=True)
                timed(f"scripted readback (forked job), {tag}",
                      lambda: _fork_readback(tokens, forked.snaps[1], dst, forked.events[1], forked.copy_stream,
                                             forked.index, True))
        timed("eager snapshot + record", lambda: (forked.snaps[2].copy_(tokens, non_blocking=True),
                                                  eager_event.record(d2h)))
        timed("eager .to(cpu, non_blocking)", lambda: tokens.to("cpu", non_blocking=True))
    for name, us in out.items():
        print(f"  {name}: {us:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    step = hb.build_step(torch, dev)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, graph {step.gpu_us():.0f} us, "
          f"inter-op threads {torch.get_num_interop_threads()}")
    d2h = torch.cuda.Stream(dev)
    setups = ("plain", "floor", "forked")
    reference: list[int] = []
    decode_loop(dev, step, d2h, args.steps, 50, "plain", reference)  # warm-up, and the tokens every setup must read
    rates = {name: [] for name in setups}
    for round_index in range(args.rounds):
        line = []
        for name in setups:
            tokens: list[int] = []
            step_again = step  # the graph's state carries over: each loop restarts its tokens from its ids
            step_again.ids.zero_()
            rate = decode_loop(dev, step_again, d2h, args.steps, 50, name, tokens)
            if name == "plain" and round_index == 0:
                reference = tokens
            mismatches = sum(a != b for a, b in zip(tokens, reference))
            rates[name].append(rate)
            line.append(f"{name} {rate:.0f} tok/s ({mismatches} tokens unlike plain's)")
        print(f"round {round_index}: " + "; ".join(line), flush=True)
    for name in setups:
        ratios = [r / p for r, p in zip(rates[name], rates["plain"])]
        print(f"host-bound loop, {name}: median {statistics.median(ratios):.3f}x plain "
              f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
    samples = {name: [] for name in setups}
    for _ in range(3):
        for name in setups:
            samples[name] += readback_samples(dev, d2h, 400, name)
    base = statistics.median(samples["plain"])
    for name in setups:
        median = statistics.median(samples[name])
        print(f"one step's readback, {name}: {median:.1f} us = {median / base:.2f}x plain")
    print("per call (median host us):")
    call_breakdown(dev, d2h)
    call_us, wait_us = call_costs(dev, d2h)
    print(f"the scripted call: {call_us:.1f} us; a finished future's wait: {wait_us:.1f} us")


if __name__ == "__main__":
    main()

"""``syncless bench cc``'s host-bound rows: a batch-1 CUDA-graphed decode loop, and one step's readback alone.

At batch 1 a decode step is a few hundred microseconds of GPU time, and
whatever the host does per step (launches, copies, scheduling) is on the
critical path. That is where CC hurts most, and where the shim's own host
time shows. The loop here:

- uploads the step's position (8 bytes, pinned, ``non_blocking``) and
  copies it into the graph's input (a device-to-device copy);
- replays a CUDA graph of about :data:`GRAPH_US` of GPU time (an embedding,
  a stack of batch-1 matmuls, a sampling head; its output token feeds the
  next step's input on the GPU, as async scheduling does);
- launches :data:`EAGER_LAUNCHES` small eager kernels (the sampler's and
  scheduler's own launches), so that the host is the bottleneck (or
  :data:`GPU_PACED_LAUNCHES`, so that the GPU is: the GPU-paced rows);
- reads the token back on ``cc.new_d2h_stream()`` and records an event, and
  reads the previous step's token after synchronizing the previous step's
  event (one step late).

:func:`readback_step_samples` times that readback alone (the ``.to("cpu",
non_blocking=True)``, the record, and the next step's synchronize) per
setup; the issue's goal compares its host time with the shim under emulated
CC to plain torch.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

GRAPH_US = 350.0  # GPU time of the captured step (calibrated by the layer count)
EAGER_LAUNCHES = 48  # eager kernels per step besides the graph (each a few microseconds of host time)
# The same loop with this many eager launches: the host's calls then take well under the graph's GPU time on any
# host, so the GPU sets the pace (as in issue 33's compiled decode loop: about 0.6 ms a step, plain at its GPU time).
GPU_PACED_LAUNCHES = 8
HIDDEN = 2048
VOCAB = 32000


class HostBoundStep:
    """A batch-1 decode step captured in a CUDA graph; ``replay()`` writes ``token`` and the next input on the GPU."""

    def __init__(self, torch: Any, dev: Any, layers: int):
        gen = torch.Generator(device=dev).manual_seed(1)
        self.torch = torch
        self.emb = torch.randn(VOCAB, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
        self.pos_emb = torch.randn(4096, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
        self.weights = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen) / 48
                        for _ in range(layers)]
        self.head = torch.randn(HIDDEN, VOCAB, device=dev, dtype=torch.bfloat16, generator=gen) / 48
        self.ids = torch.zeros(1, dtype=torch.int64, device=dev)  # the previous token (written by the graph)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)  # uploaded by the host each step
        self.token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.scratch = torch.zeros(64, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._forward()
        torch.cuda.synchronize(dev)

    def _forward(self) -> None:
        torch = self.torch
        x = self.emb[self.ids] + self.pos_emb[self.pos % 4096]
        for weight in self.weights:
            x = torch.nn.functional.gelu(x @ weight)
        token = (x @ self.head).argmax(dim=-1)
        self.token.copy_(token)
        self.ids.copy_(token)

    def gpu_us(self) -> float:
        """Median GPU time of one replay, in microseconds."""
        torch = self.torch
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000)
        return statistics.median(times)


def build_step(torch: Any, dev: Any) -> HostBoundStep:
    """A :class:`HostBoundStep` with about :data:`GRAPH_US` of GPU time (layers added until it is reached)."""
    layers = 4
    step = HostBoundStep(torch, dev, layers)
    per_layer = max(1.0, (step.gpu_us() - 60.0) / layers)
    layers = max(1, int((GRAPH_US - 60.0) / per_layer))
    return HostBoundStep(torch, dev, layers)


def transfer_wait(d2h: Any):
    """The wait CC makes the calling thread pay for a readback on ``d2h`` and nothing more (the transfer floor): one
    ``cuStreamSynchronize`` of ``d2h`` through ctypes, no torch or syncless code around it."""
    from syncless._core import libcuda

    blocking = libcuda.libraries()[1]
    handle = d2h.cuda_stream

    def wait() -> None:
        code = blocking.cuStreamSynchronize(handle)
        if code:
            libcuda.raise_for("cuStreamSynchronize", code)

    return wait


def decode_loop(torch: Any, dev: Any, step: HostBoundStep, d2h: Any, steps: int, warmup: int,
                floor: bool = False, waits: list | None = None, launches: int = EAGER_LAUNCHES,
                stream_waits: list | None = None) -> float:
    """Run the host-bound loop; return tokens per second over the measured steps (batch 1: a token per step).

    ``floor``: plain torch, and after each readback the wait for its transfer (:func:`transfer_wait`): what CC
    costs a loop whose copies are made on its own thread by a shim that costs nothing itself (its upload written
    by a kernel, which needs no wait), so the most a shim reading back at the call can reach. ``waits``: gets the
    host's time (us) in each measured step's one-step-late synchronize: near 0 where the host sets the pace;
    where the GPU does, the host's time to spare (a shim that does not wait at the call can spend it).
    ``launches``: the eager launches per step (:data:`GPU_PACED_LAUNCHES`: the GPU sets the pace).
    ``stream_waits``: gets the host's time (us) in each measured step's ``d2h.wait_stream(current)``: an enqueue for
    torch; with the shim and a readback offloaded, also the previous step's copy (the event its patch records covers
    that copy, so it runs the job first), which moves the host's wait from the late synchronize to here.
    """
    current = torch.cuda.current_stream(dev)
    wait = transfer_wait(d2h) if floor else None
    ring = [torch.zeros(1, dtype=torch.int64, pin_memory=True) for _ in range(4)]  # rewritten 4 steps later
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
        for _ in range(launches):  # the sampler's and scheduler's own small launches
            step.scratch.add_(1.0)
        if stream_waits is not None and index >= warmup:
            t_stream = time.perf_counter()
            d2h.wait_stream(current)
            stream_waits.append((time.perf_counter() - t_stream) * 1e6)
        else:
            d2h.wait_stream(current)
        with torch.cuda.stream(d2h):
            token_host = step.token.to("cpu", non_blocking=True)
            if wait is not None:
                wait()
            ready = torch.cuda.Event()
            ready.record(d2h)
        if pending is not None:  # the previous step's token, one step late
            t0 = time.perf_counter()
            pending[1].synchronize()
            if waits is not None and index >= warmup:
                waits.append((time.perf_counter() - t0) * 1e6)
            int(pending[0][0])
        pending = (token_host, ready)
    pending[1].synchronize()
    torch.cuda.synchronize(dev)
    return steps / (time.perf_counter() - start_s)


def readback_step_samples(torch: Any, dev: Any, d2h: Any, steps: int, floor: bool = False) -> list[float]:
    """Host times (us) of one step's token readback: 8 int64 D2H on ``d2h`` and an event, read one step late.

    Counts the ``.to("cpu", non_blocking=True)``, the event's record and the next step's synchronize of it, with
    a small kernel producing the tokens each step. ``floor``: plain torch and the wait for the transfer, as in
    :func:`decode_loop`.
    """
    current = torch.cuda.current_stream(dev)
    wait = transfer_wait(d2h) if floor else None
    tokens = torch.zeros(8, dtype=torch.int64, device=dev)
    pending = None
    times = []
    for index in range(steps + 10):
        tokens.add_(1)
        d2h.wait_stream(current)
        t0 = time.perf_counter()
        with torch.cuda.stream(d2h):
            host = tokens.to("cpu", non_blocking=True)
            if wait is not None:
                wait()
            ready = torch.cuda.Event()
            ready.record(d2h)
        spent = time.perf_counter() - t0
        if pending is not None:
            t1 = time.perf_counter()
            pending[1].synchronize()
            spent += time.perf_counter() - t1
            if int(pending[0][0]) != index:  # the previous step's tokens, exactly
                raise RuntimeError(f"readback step {index}: read {int(pending[0][0])}, expected {index}")
        if index >= 10:
            times.append(spent * 1e6)
        pending = (host, ready)
    pending[1].synchronize()
    return times

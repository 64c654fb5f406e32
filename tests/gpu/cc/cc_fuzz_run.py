"""Run ``cc_fuzz`` programs: on a GPU through torch (:class:`TorchBackend`), or on a simulated GPU (:class:`SimBackend`).

One interpreter (:class:`Runner`) turns each op into calls on a backend:
``launch(stream, fn)`` for work a stream performs, plus waits, events and
synchronizes. On the GPU, ``launch`` makes the stream current and calls
``fn`` (torch enqueues the work). The simulator instead queues ``fn`` on
the stream and runs queued work in a random order that respects only what
CUDA guarantees (stream order, waits on streams and events, host
synchronizes), on CPU tensors. A legal program gives the same results under
every such schedule; that is how the CPU tests check the generator.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from cc_fuzz import (DTYPES, N_DEV, N_EVENTS, N_HOST, SIDE, STREAMS, Op, ProgramSpec, apply_view,
                     d2h_fresh_fills_on_host, fresh_result_view, h2d_reads_host_now)


def digest(t: Any) -> str:
    """The dtype, shape and bytes of a CPU tensor, hashed."""
    import torch

    c = t.detach().contiguous()
    raw = c.view(torch.uint8) if c.dim() else c.reshape(1).view(torch.uint8)
    return f"{c.dtype}{tuple(c.shape)}:" + hashlib.sha1(raw.numpy().tobytes()).hexdigest()[:16]


def values(gen: Any, dtype: Any) -> Any:
    """Fresh SIDE x SIDE values (small integers, exact in every dtype used) from ``gen``."""
    import torch

    return torch.randint(-64, 64, (SIDE, SIDE), generator=gen, dtype=torch.int32).to(dtype)


# -- backends -------------------------------------------------------------------------------------------------

class TorchBackend:
    """The real thing: four CUDA streams (two from ``cc.new_d2h_stream``), torch events."""

    simulated = False

    def __init__(self, cc: Any, device: Any):
        import torch

        self.torch, self.cc, self.device = torch, cc, device
        self.streams = {
            "S0": torch.cuda.Stream(device),
            "S1": torch.cuda.Stream(device),
            "D2": cc.new_d2h_stream(device),
            "D3": cc.new_d2h_stream(device),
        }

    def begin(self) -> None:
        torch = self.torch
        # Half torch.cuda.Event, half torch.Event (made now: under the shim that is its covering subclass).
        self.events = [torch.cuda.Event() if i % 2 == 0 else torch.Event(device=self.device) for i in range(N_EVENTS)]

    def to_device(self, t: Any) -> Any:
        return t.to(self.device)

    def pin(self, t: Any) -> Any:
        return t.pin_memory()

    def current(self, s: str):
        return self.torch.cuda.stream(self.streams[s])

    def launch(self, s: str, fn: Callable[[], Any]) -> Any:
        with self.torch.cuda.stream(self.streams[s]):
            return fn()

    def sleep(self, cycles: int) -> None:
        self.torch.cuda._sleep(cycles)

    def wait_stream(self, a: str, b: str) -> None:
        self.streams[a].wait_stream(self.streams[b])

    def record(self, e: int, s: str, form: int) -> None:
        torch, event, stream = self.torch, self.events[e], self.streams[s]
        if form == 0:
            event.record(stream)
        elif form == 1 and isinstance(event, torch.cuda.Event):
            stream.record_event(event)
        else:
            with torch.cuda.stream(stream):
                event.record()

    def wait_event(self, s: str, e: int, form: int) -> None:
        torch, event, stream = self.torch, self.events[e], self.streams[s]
        if form == 0 and isinstance(event, torch.cuda.Event):
            stream.wait_event(event)
        elif form == 1:
            event.wait(stream)
        else:
            with torch.cuda.stream(stream):
                event.wait()

    def event_sync(self, e: int) -> None:
        self.events[e].synchronize()

    def event_query(self, e: int) -> bool:
        return self.events[e].query()

    def stream_sync(self, s: str) -> None:
        self.streams[s].synchronize()

    def device_sync(self, form: int) -> None:
        torch = self.torch
        accelerator = getattr(torch, "accelerator", None)
        if form == 1 and accelerator is not None and hasattr(accelerator, "synchronize"):
            accelerator.synchronize()
        else:
            torch.cuda.synchronize()

    def record_stream(self, t: Any, s: str) -> None:
        t.record_stream(self.streams[s])

    def register(self, t: Any, s: str) -> None:
        if self.cc.is_installed():  # plain torch has no such thing; the oracle runs without it
            with self.torch.cuda.stream(self.streams[s]):
                self.cc.register_inplace_h2d_target(t)

    def progress(self) -> None:
        """The GPU makes progress by itself."""

    def to_host(self, t: Any) -> Any:
        return t.cpu()


class SimBackend:
    """A simulated GPU: per-stream queues run in a random order that only CUDA's guarantees constrain.

    ``schedule_seed=None`` runs each launch at once (one legal schedule: program order).
    """

    simulated = True

    def __init__(self, schedule_seed: int | None):
        import torch

        self.torch = torch
        self.device = torch.device("cpu")
        self.rng = None if schedule_seed is None else random.Random(schedule_seed)
        self.streams = dict.fromkeys(STREAMS)

    def begin(self) -> None:
        self.queues = {s: collections.deque() for s in STREAMS}
        self.enqueued = dict.fromkeys(STREAMS, 0)
        self.done = dict.fromkeys(STREAMS, 0)
        self.events: list[tuple | None] = [None] * N_EVENTS  # (stream, position) of the latest record
        self._current = None

    def to_device(self, t: Any) -> Any:
        return t.clone()

    def pin(self, t: Any) -> Any:
        return t

    @contextlib.contextmanager
    def current(self, s: str):
        self._current = s
        try:
            yield
        finally:
            self._current = None

    def _push(self, s: str, item: tuple) -> None:
        self.queues[s].append(item)
        self.enqueued[s] += 1

    def launch(self, s: str, fn: Callable[[], Any]) -> None:
        self._push(s, ("run", fn))
        if self.rng is None:
            self._drain(lambda: self.done[s] >= self.enqueued[s])

    def sleep(self, cycles: int) -> None:  # a no-op that still takes a place in the queue
        self._push(self._current, ("run", lambda: None))

    def wait_stream(self, a: str, b: str) -> None:
        self._push(a, ("wait", b, self.enqueued[b]))

    def record(self, e: int, s: str, form: int) -> None:
        self.events[e] = (s, self.enqueued[s])

    def wait_event(self, s: str, e: int, form: int) -> None:
        if self.events[e] is not None:
            self._push(s, ("wait",) + self.events[e])

    def _ready(self, s: str) -> bool:
        queue = self.queues[s]
        if not queue:
            return False
        head = queue[0]
        return head[0] == "run" or self.done[head[1]] >= head[2]

    def _step(self, s: str) -> None:
        head = self.queues[s].popleft()
        if head[0] == "run":
            head[1]()
        self.done[s] += 1

    def _drain(self, until: Callable[[], bool]) -> None:
        while not until():
            ready = [s for s in STREAMS if self._ready(s)]
            if not ready:
                raise RuntimeError("the simulated GPU is stuck: a wait that can never be satisfied")
            self._step(ready[0] if self.rng is None else self.rng.choice(ready))

    def progress(self) -> None:
        """Run a random amount of queued work (the GPU moves on while the host does other things)."""
        for _ in range(10**9 if self.rng is None else self.rng.randint(0, 6)):
            ready = [s for s in STREAMS if self._ready(s)]
            if not ready:
                return
            self._step(ready[0] if self.rng is None else self.rng.choice(ready))

    def event_sync(self, e: int) -> None:
        if self.events[e] is not None:
            s, position = self.events[e]
            self._drain(lambda: self.done[s] >= position)

    def event_query(self, e: int) -> bool:
        if self.events[e] is None:
            return True
        s, position = self.events[e]
        return self.done[s] >= position

    def stream_sync(self, s: str) -> None:
        target = self.enqueued[s]
        self._drain(lambda: self.done[s] >= target)

    def device_sync(self, form: int) -> None:
        targets = dict(self.enqueued)
        self._drain(lambda: all(self.done[s] >= targets[s] for s in STREAMS))

    def record_stream(self, t: Any, s: str) -> None:
        """No allocator here: nothing to do."""

    def register(self, t: Any, s: str) -> None:
        """No shim here: nothing to do."""

    def to_host(self, t: Any) -> Any:
        return t


# -- the interpreter ------------------------------------------------------------------------------------------

class Runner:
    """Runs a program on a backend; returns the digests of every host read, then of every buffer at the end."""

    def __init__(self, backend: Any):
        import torch

        self.b = backend
        self.torch = torch
        self._sink = threading.local()
        gen = torch.Generator().manual_seed(1234)
        # Read-only operands of KERNEL and HOST_WRITE, the same for every program (fresh data is in the buffers).
        self.host_patterns = {name: [values(gen, getattr(torch, name)) for _ in range(4)] for name in DTYPES}
        self.dev_patterns = {name: [backend.to_device(p) for p in pats] for name, pats in self.host_patterns.items()}

    def run(self, spec: ProgramSpec) -> list[str]:
        torch, b = self.torch, self.b
        gen = torch.Generator().manual_seed(spec.seed)
        b.begin()
        self.host = []
        for i in range(N_HOST):
            t = values(gen, getattr(torch, spec.host_dtypes[i]))
            self.host.append(b.pin(t) if spec.host_pinned[i] else t)
        self.dev = [b.to_device(values(gen, getattr(torch, spec.dev_dtypes[i]))) for i in range(N_DEV)]
        self.reads: list[str] = []
        # The simulator plays CC without the shim for a cc-oracle program: every host<->device copy drains its stream.
        self.cc_mode = spec.oracle == "cc"
        b.device_sync(0)  # the initial state is settled before the program starts (the model's INIT)
        for op in spec.ops:
            self._run(op)
        b.device_sync(0)
        out = list(self.reads)
        out += [digest(t) for t in self.host]
        out += ["freed" if t is None else digest(b.to_host(t)) for t in self.dev]
        self.host = self.dev = None
        return out

    def _pattern(self, t: Any, pattern: int, view: tuple, host: bool) -> Any:
        table = self.host_patterns if host else self.dev_patterns
        return apply_view(table[str(t.dtype).split(".")[1]][pattern], view)

    def _run(self, op: Op) -> None:  # noqa: C901 - one branch per kind
        torch, b, k, a = self.torch, self.b, op.kind, op.args
        b.progress()
        if k == "THREAD":
            self._run_thread(op)
        elif k == "CONCURRENT":
            self._run_concurrent(op)
        elif k == "SLEEP":
            with b.current(a[0]):
                b.sleep(a[1])
        elif k == "KERNEL":
            s, g, view, pattern, cycles = a
            target = apply_view(self.dev[g], view)
            operand = self._pattern(target, pattern, view, host=False)
            with b.current(s):
                if cycles:
                    b.sleep(cycles)  # a slow producer
                b.launch(s, lambda: (target.neg_(), target.add_(operand)))
        elif k == "FILL":
            target = apply_view(self.dev[a[1]], a[2])
            with b.current(a[0]):
                b.launch(a[0], lambda: target.fill_(a[3]))
        elif k == "H2D":
            s, h, hv, g, gv, nb = a[:6]
            src = apply_view(self.host[h], hv)
            if self.b.simulated and h2d_reads_host_now(hv, gv, nb, str(self.host[h].dtype)[6:],
                                                           str(self.dev[g].dtype)[6:]):
                src = src.clone()  # as torch does, the host is read now (see h2d_reads_host_now)
            self._copy(s, apply_view(self.dev[g], gv), src, nb, a[6] if len(a) > 6 else "copy_")
        elif k == "D2H":
            s, g, gv, h, hv, nb = a[:6]
            self._copy(s, apply_view(self.host[h], hv), apply_view(self.dev[g], gv), nb, a[6] if len(a) > 6 else "copy_")
        elif k == "D2D":
            s, g1, v1, g2, v2, nb = a
            dst, src = apply_view(self.dev[g2], v2), apply_view(self.dev[g1], v1)
            with b.current(s):
                b.launch(s, lambda: dst.copy_(src, non_blocking=nb))
        elif k == "H2D_FRESH":
            self._h2d_fresh(*a)
        elif k == "D2H_FRESH":
            self._d2h_fresh(*a)
        elif k == "BLOCKING_READ":
            self._blocking_read(*a)
        elif k == "WAIT_STREAM":
            b.wait_stream(a[0], a[1])
        elif k == "RECORD":
            b.record(*a)
        elif k == "WAIT_EVENT":
            b.wait_event(*a)
        elif k == "EVENT_SYNC":
            b.event_sync(a[0])
        elif k == "EVENT_SPIN":
            deadline = time.monotonic() + 60
            while not b.event_query(a[0]):
                if time.monotonic() > deadline:
                    raise TimeoutError("an event never completed")
                b.progress()
                time.sleep(0)
        elif k == "EVENT_QUERY":
            b.event_query(a[0])
        elif k == "STREAM_SYNC":
            b.stream_sync(a[0])
        elif k == "DEVICE_SYNC":
            b.device_sync(a[0])
        elif k == "HOST_READ":
            # A concurrent body reads into its own list (the bodies' reads interleave in any order).
            getattr(self._sink, "reads", self.reads).append(digest(apply_view(self.host[a[0]], a[1]).clone()))
        elif k == "HOST_WRITE":
            h, hv, pattern = a
            target = apply_view(self.host[h], hv)
            target.copy_(self._pattern(target, pattern, hv, host=True))
        elif k == "RECORD_STREAM":
            b.record_stream(self.dev[a[0]], a[1])
        elif k == "FREE":
            self.dev[a[0]] = None
        elif k == "ALLOC":
            s, g, dtype, value = a
            if b.simulated:
                t = torch.empty((SIDE, SIDE), dtype=getattr(torch, dtype))
                b.launch(s, lambda: t.fill_(value))
            else:
                t = b.launch(s, lambda: torch.full((SIDE, SIDE), value, dtype=getattr(torch, dtype), device=b.device))
            self.dev[g] = t
        elif k == "REGISTER":
            b.register(self.dev[a[0]], a[1])
        else:
            raise ValueError(f"unknown op kind {k!r}")

    def _copy(self, s: str, dst: Any, src: Any, nb: bool, via: str = "copy_") -> None:
        """A host<->device copy on ``s``, spelled ``via`` (``copy_``; blocking ``setitem`` or ``storage`` copies, which
        torch runs in C++ without the patched ``copy_``: cc_fuzz_gen's ``_via``)."""
        b = self.b
        if not b.simulated:
            if via == "setitem":
                b.launch(s, lambda: dst.__setitem__(Ellipsis, src))
            elif via == "storage":
                b.launch(s, lambda: dst.untyped_storage().copy_(src.untyped_storage()))
            else:
                b.launch(s, lambda: dst.copy_(src, non_blocking=nb))
            return
        b.launch(s, lambda: dst.copy_(src))
        if not nb or self.cc_mode:
            b.stream_sync(s)  # torch's blocking copy: cudaMemcpyAsync then cudaStreamSynchronize (and CC's copy)

    def _h2d_fresh(self, s: str, h: int, g: int, nb: bool, form: int, dtype: str | None, hv: tuple) -> None:
        torch, b = self.torch, self.b
        src = apply_view(self.host[h], hv)
        transposed_result = fresh_result_view(hv, form) == ("t",)
        if b.simulated:
            out = torch.empty(tuple(src.shape), dtype=src.dtype if dtype is None else getattr(torch, dtype))
            host_dtype = str(src.dtype)[6:]
            if h2d_reads_host_now(hv, fresh_result_view(hv, form), nb, host_dtype, dtype or host_dtype):
                src = src.clone()  # as torch does, the host is read now (see h2d_reads_host_now)
            target = out.t() if transposed_result else out  # the slot holds what the real run's slot holds
            b.launch(s, lambda: target.copy_(src))
            if self.cc_mode and nb:
                b.stream_sync(s)  # CC's copy returns once its stream has drained
            self.dev[g] = out
            return
        elif form == 3:
            kwargs = {} if dtype is None else {"dtype": getattr(torch, dtype)}
            out = b.launch(s, lambda: src.to(b.device, non_blocking=nb, memory_format=torch.contiguous_format,
                                             **kwargs))
        elif dtype is not None:
            out = b.launch(s, lambda: src.to(b.device, dtype=getattr(torch, dtype), non_blocking=nb))
        elif form == 0:
            out = b.launch(s, lambda: src.to(b.device, non_blocking=nb))
        elif form == 1:
            out = b.launch(s, lambda: src.to(device="cuda", non_blocking=nb))
        else:
            out = b.launch(s, lambda: src.cuda(non_blocking=nb))
        # torch's result of a transposed source keeps its strides (preserve_format); the slot keeps its transpose,
        # a contiguous view of the same memory, so that later views of the slot stay valid (the values are those
        # of the host source transposed, in every configuration alike).
        self.dev[g] = out.t() if transposed_result else out

    def _blocking_read(self, s: str, g: int, form: int) -> None:
        """``dev[g].cpu()``, ``.item()`` of one element or ``.tolist()`` of a row, with ``s`` current; kept as a read."""
        torch, b, src = self.torch, self.b, self.dev[g]
        sink = getattr(self._sink, "reads", self.reads)
        if b.simulated:
            out = torch.empty(tuple(src.shape), dtype=src.dtype)
            b.launch(s, lambda: out.copy_(src))
            b.stream_sync(s)
            value = out.clone() if form == 0 else out[0, 0].item() if form == 1 else out[0].tolist()
        else:
            value = b.launch(s, lambda: src.cpu() if form == 0 else src[0, 0].item() if form == 1 else src[0].tolist())
        sink.append(digest(value) if form == 0 else repr(value))

    def _d2h_fresh(self, s: str, g: int, h: int, nb: bool, dtype: str | None, view: tuple = ("full",)) -> None:
        torch, b = self.torch, self.b
        src = apply_view(self.dev[g], view)
        if b.simulated:
            out = torch.empty(tuple(src.shape), dtype=src.dtype if dtype is None else getattr(torch, dtype))
            target = out.t() if view == ("t",) else out  # the slot holds what the real run's slot holds
            b.launch(s, lambda: target.copy_(src))
            if not nb or self.cc_mode or d2h_fresh_fills_on_host(view, nb, str(src.dtype)[6:], dtype):
                b.stream_sync(s)  # blocking, CC's drain, or torch's pageable temporary (the host waits for it)
            self.host[h] = out
            return
        elif dtype is None:
            out = b.launch(s, lambda: src.to("cpu", non_blocking=nb))
        else:
            out = b.launch(s, lambda: src.to("cpu", dtype=getattr(torch, dtype), non_blocking=nb))
        # A transposed source gives a transposed result; the slot keeps its transpose, a contiguous view of the same
        # memory holding dev[g]'s values, so later views of the slot stay SIDE x SIDE (as for H2D_FRESH).
        self.host[h] = out.t() if view == ("t",) else out

    def _run_thread(self, op: Op) -> None:
        if self.b.simulated:  # the simulator is single-threaded; the order is the same
            for inner in op.body:
                self._run(inner)
            return
        self._in_threads([op.body], [getattr(self._sink, "reads", None)])  # inside a concurrent body: its list

    def _run_concurrent(self, op: Op) -> None:
        bodies = [list(thread.body) for thread in op.body]
        sinks: list[list[str]] = [[] for _ in bodies]
        if not self.b.simulated:
            self._in_threads(bodies, sinks)
        else:
            # The simulator interleaves the two bodies at random, op by op (each body keeps its own order).
            rng = self.b.rng
            while any(bodies):
                pending = [i for i, body in enumerate(bodies) if body]
                i = pending[0] if rng is None else rng.choice(pending)
                self._sink.reads = sinks[i]
                try:
                    self._run(bodies[i].pop(0))
                finally:
                    del self._sink.reads
        for sink in sinks:
            self.reads.extend(sink)

    def _in_threads(self, bodies: list, sinks: list | None = None) -> None:
        """Run each body on its own new host thread, all at once; re-raise the first error."""
        errors: list[BaseException] = []

        def run_body(ops, sink) -> None:
            if sink is not None:
                self._sink.reads = sink
            try:
                for inner in ops:
                    self._run(inner)
            except BaseException as err:  # noqa: BLE001 - re-raised on the main thread below
                errors.append(err)

        threads = [threading.Thread(target=run_body, args=(ops, None if sinks is None else sinks[i]),
                                    name=f"cc-fuzz-thread-{i}") for i, ops in enumerate(bodies)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
            if thread.is_alive():
                raise TimeoutError(f"{thread.name} did not finish within 60 s")
        if errors:
            raise errors[0]

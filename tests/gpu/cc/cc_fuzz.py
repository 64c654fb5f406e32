"""A differential fuzzer for ``syncless.cc``: random stream programs, plain torch as the oracle.

A *program* is a list of :class:`Op` over four streams (two ordinary, two
from ``cc.new_d2h_stream``), device buffers (slots that are allocated,
freed and re-allocated, so the caching allocator reuses blocks), host
buffers (pinned and pageable), and events. It is run once under plain torch
(the oracle) and once under a configuration of the shim and the CC
emulator; the host-visible results (every host read the program makes, and
every buffer at the end) must be bit-identical.

Only programs that are *correct under plain torch* are generated: every
access is ordered after the accesses it conflicts with (read after write,
write after read or write), by torch's own rules. :class:`Model` decides
that with vector clocks:

- each stream ``s`` has a clock ``vc[s]`` (what it is ordered after); an
  access enqueued on ``s`` gets the tick ``vc[s][s] + 1``;
- ``a.wait_stream(b)`` merges ``vc[b]`` into ``vc[a]``; ``e.record(s)``
  stores ``vc[s]`` in ``e``; ``s.wait_event(e)`` merges it into ``vc[s]``;
- ``host`` is what the host knows to be finished: an event, stream or
  device synchronize merges the matching clocks into it; a blocking D2H
  copy synchronizes its stream (torch's ``memcpy_and_sync``);
- a GPU access on ``s`` is ordered after ``(p, t)`` if ``vc[s][p] >= t`` or
  ``host[p] >= t`` (the host saw it finish before enqueuing); a host access
  only if ``host[p] >= t``;
- freeing a device buffer needs every use on another stream than its
  allocation stream ordered before the allocation stream, finished, or
  declared with ``record_stream``;
- an H2D into a registered in-place target needs every earlier access of
  the target finished (the promise ``register_inplace_h2d_target`` asks for).

Anything the model is unsure of, it forbids: a conservative model generates
fewer programs, never a wrong one. The generator (``cc_fuzz_gen.py``) picks
an operation, and if the model forbids it, inserts an ordering that makes it
legal (a ``wait_stream``, an event, a synchronize) or drops it.

This module is plain Python; ``cc_fuzz_run.py`` runs programs on torch (a
GPU) or on a simulated GPU on the CPU (``tests/unit/cc/test_cc_fuzz_cpu.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

STREAMS = ("S0", "S1", "D2", "D3")  # S*: torch.cuda.Stream(); D*: cc.new_d2h_stream()
INIT = "init"  # the stream the program's initial buffers were made on (settled before the program starts)
N_DEV, N_HOST, N_EVENTS = 5, 4, 3
SIDE = 32  # every buffer is SIDE x SIDE
DTYPES = ("float32", "float16", "bfloat16", "int32", "float64")
# CONCURRENT blocks: two host threads at once, each on its own streams, buffers and events.
PARTS = (
    {"streams": ("S0", "D2"), "dev": (0, 1), "host": (0, 1), "events": (0,)},
    {"streams": ("S1", "D3"), "dev": (2, 3, 4), "host": (2, 3), "events": (1, 2)},
)
SHORT_SLEEPS = (0, 0, 2_000, 10_000, 40_000)  # GPU cycles: 0 to ~20 us on an H200
LONG_SLEEP = 2_000_000  # ~1 ms: in a few programs, to open race windows wide


@dataclass(frozen=True)
class Op:
    """One operation; ``args`` holds only small ints/strings/tuples, so a program prints and replays."""

    kind: str
    args: tuple = ()
    body: tuple = ()  # THREAD: the ops run on a second host thread; CONCURRENT: two THREADs run at once

    def __str__(self) -> str:
        if self.kind in ("THREAD", "CONCURRENT"):
            inner = " | ".join(str(op) for op in self.body) if self.kind == "CONCURRENT" else "; ".join(
                str(op) for op in self.body)
            return f"{self.kind} {{ {inner} }}"
        return f"{self.kind}{self.args}"


_STREAM_ARGS = {  # positions of stream names, device slots, host slots, events in each kind's args
    "SLEEP": ((0,), (), (), ()), "KERNEL": ((0,), (1,), (), ()), "FILL": ((0,), (1,), (), ()),
    "H2D": ((0,), (3,), (1,), ()), "H2D_FRESH": ((0,), (2,), (1,), ()), "D2H": ((0,), (1,), (3,), ()),
    "BLOCKING_READ": ((0,), (1,), (), ()),
    "D2H_FRESH": ((0,), (1,), (2,), ()), "D2D": ((0,), (1, 3), (), ()), "WAIT_STREAM": ((0, 1), (), (), ()),
    "RECORD": ((1,), (), (), (0,)), "WAIT_EVENT": ((0,), (), (), (1,)), "EVENT_SYNC": ((), (), (), (0,)),
    "EVENT_SPIN": ((), (), (), (0,)), "EVENT_QUERY": ((), (), (), (0,)), "STREAM_SYNC": ((0,), (), (), ()),
    "DEVICE_SYNC": ((), (), (), ()), "HOST_READ": ((), (), (0,), ()), "HOST_WRITE": ((), (), (0,), ()),
    "RECORD_STREAM": ((1,), (0,), (), ()), "FREE": ((), (0,), (), ()), "ALLOC": ((0,), (1,), (), ()),
    "REGISTER": ((1,), (0,), (), ()),
}


def within(op: Op, part: dict) -> bool:
    """Return whether ``op`` (and everything in its body) touches only the streams, buffers and events of ``part``."""
    if op.kind in ("THREAD", "CONCURRENT"):
        return op.kind == "THREAD" and all(within(inner, part) for inner in op.body)
    streams, dev, host, events = _STREAM_ARGS[op.kind]
    return (all(op.args[i] in part["streams"] for i in streams) and all(op.args[i] in part["dev"] for i in dev)
            and all(op.args[i] in part["host"] for i in host) and all(op.args[i] in part["events"] for i in events))


@dataclass
class ProgramSpec:
    """A program and the initial state it starts from."""

    seed: int
    host_pinned: tuple  # per host slot
    host_dtypes: tuple
    dev_dtypes: tuple
    ops: list = field(default_factory=list)
    # Which oracle the program is correct for: "torch" (plain torch) or "cc" (CC without the shim, cc.emulate()
    # alone, where every host<->device copy has finished when its call returns; see Model).
    oracle: str = "torch"

    def copy_with(self, ops: Sequence[Op]) -> ProgramSpec:
        return ProgramSpec(self.seed, self.host_pinned, self.host_dtypes, self.dev_dtypes, list(ops), self.oracle)

    def describe(self) -> str:
        head = (f"seed={self.seed} oracle={self.oracle} host_pinned={self.host_pinned} host_dtypes={self.host_dtypes} "
                f"dev_dtypes={self.dev_dtypes}")
        return "\n".join([head] + [f"  {i:3d}: {op}" for i, op in enumerate(self.ops)])


# -- views ----------------------------------------------------------------------------------------------------

def view_shape(spec: tuple) -> tuple:
    kind = spec[0]
    if kind in ("full", "t"):
        return (SIDE, SIDE)
    if kind == "rows":
        return (spec[2] - spec[1], SIDE)
    if kind == "cols":
        return (SIDE, spec[2] - spec[1])
    if kind == "step":
        return (SIDE * SIDE // 2,)
    raise ValueError(f"unknown view {spec!r}")


CONTIGUOUS_VIEWS = ("full", "rows")  # the views of a SIDE x SIDE tensor that are contiguous ("cols" is, if full width)


def h2d_reads_host_now(host_view: tuple, dev_view: tuple, non_blocking: bool, host_dtype: str,
                       dev_dtype: str) -> bool:
    """Whether torch reads an H2D copy's host source when the call is made, not in its stream's order.

    With equal dtypes and one dense layout on both sides (both contiguous, or
    both transposed) torch moves the block as it lies, in stream order.
    Otherwise it goes through temporaries: a non-contiguous host source is
    made contiguous first, and a blocking copy converts the dtype on the
    host, both at once; only then does the transfer itself go on the stream.
    """
    if not non_blocking and host_dtype != dev_dtype:
        return True
    if host_dtype == dev_dtype and _dense_layout(host_view) is not None and (
            _dense_layout(host_view) == _dense_layout(dev_view)):
        return False
    return _dense_layout(host_view) != "contiguous"  # a contiguous source is its own temporary


def d2h_fresh_fills_on_host(view: tuple, non_blocking: bool, src_dtype: str, dtype: str | None) -> bool:
    """Whether torch's ``src_view.to("cpu", dtype, non_blocking=True)`` writes its result on the host at the call.

    The result keeps a dense source's layout; a transposed result with another dtype goes through a pageable
    contiguous temporary that torch copies into the pinned result before it returns (issue 27 item 2).
    """
    return non_blocking and view == ("t",) and dtype is not None and dtype != src_dtype


FRESH_FORMS = 4  # H2D_FRESH forms: .to(device), .to(device="cuda"), .cuda(), .to(device, memory_format=contiguous)


def fresh_result_view(host_view: tuple, form: int) -> tuple:
    """The layout of a fresh H2D's result, as a view: the source's own (torch's preserve_format on a dense source),
    or contiguous for the form that asks ``memory_format=torch.contiguous_format``."""
    return ("full",) if form == 3 else host_view


def _dense_layout(view: tuple) -> str | None:
    """The dense layout of a view of a SIDE x SIDE tensor ("contiguous", "transposed"), None if not dense."""
    if view[0] in CONTIGUOUS_VIEWS or (view[0] == "cols" and view[2] - view[1] == SIDE):
        return "contiguous"
    return "transposed" if view[0] == "t" else None


def apply_view(t: Any, spec: tuple) -> Any:
    """The view ``spec`` of a SIDE x SIDE tensor (contiguous or not)."""
    kind = spec[0]
    if kind == "full":
        return t
    if kind == "t":
        return t.t()
    if kind == "rows":
        return t[spec[1]:spec[2]]
    if kind == "cols":
        return t[:, spec[1]:spec[2]]
    if kind == "step":
        return t.view(-1)[spec[1]::2]
    raise ValueError(f"unknown view {spec!r}")


def random_view_pair(rng: random.Random) -> tuple[tuple, tuple]:
    """Return (dst view, src view) of the same shape."""
    pick = rng.random()
    if pick < 0.4:
        return ("full",), ("full",)
    if pick < 0.55:
        return rng.choice([(("full",), ("t",)), (("t",), ("full",)), (("t",), ("t",))])
    if pick < 0.7:
        n = rng.randint(1, SIDE)
        a, c = rng.randint(0, SIDE - n), rng.randint(0, SIDE - n)
        return ("rows", a, a + n), ("rows", c, c + n)
    if pick < 0.85:
        n = rng.randint(1, SIDE)
        a, c = rng.randint(0, SIDE - n), rng.randint(0, SIDE - n)
        return ("cols", a, a + n), ("cols", c, c + n)
    return ("step", rng.randint(0, 1)), ("step", rng.randint(0, 1))


# -- the model ------------------------------------------------------------------------------------------------

class Illegal(Exception):
    """The op is not correct under plain torch in this state; ``needs`` says what would make it legal."""

    def __init__(self, reason: str, needs: list):
        super().__init__(reason)
        self.needs = needs  # [("stream", s, p, t)] or [("host", p, t)]


@dataclass
class _Buf:
    write: tuple | None = None  # (stream or "host", tick)
    reads: list = field(default_factory=list)
    alloc: str = INIT
    recorded: set = field(default_factory=set)  # record_stream(s) calls
    used_on: dict = field(default_factory=dict)  # stream -> its latest GPU access tick since allocation
    registered: bool = False
    dtype: str = "float32"

    def clone(self) -> _Buf:
        return _Buf(self.write, list(self.reads), self.alloc, set(self.recorded), dict(self.used_on),
                    self.registered, self.dtype)


class Model:
    """Torch's ordering rules over a program's streams, events and buffers (see the module docstring)."""

    def __init__(self, spec: ProgramSpec):
        self.vc = {s: {} for s in STREAMS}
        self.host: dict[str, int] = {INIT: 1}
        self.events: dict[int, dict | None] = dict.fromkeys(range(N_EVENTS))
        self.dev = [_Buf(write=(INIT, 1), dtype=spec.dev_dtypes[i], used_on={INIT: 1}) for i in range(N_DEV)]
        self.hst = [_Buf(write=("host", 0), dtype=spec.host_dtypes[i]) for i in range(N_HOST)]
        self.pinned = list(spec.host_pinned)
        self.part: dict | None = None  # while generating one body of a CONCURRENT block: its resources
        # The "cc" oracle (CC without the shim): the same GPU ordering, but a non_blocking host<->device copy has
        # finished when its call returns, except that under the shim a non_blocking D2H on a D2H stream may be
        # offloaded. Its host write is then a *job*, ("job", (stream, n)), known finished only after a call that
        # covers it by the seed's rule (docs/cc.md): a synchronize of, or a wait on, an event recorded after it;
        # a wait_stream; a synchronize of an ordinary stream, of its own D2H stream, or of the device.
        self.cc = spec.oracle == "cc"
        self.jobs: dict[tuple, str] = {}  # uncovered jobs -> their D2H stream
        self.job_count = dict.fromkeys(STREAMS, 0)
        self.event_jobs: dict[int, frozenset] = dict.fromkeys(range(N_EVENTS), frozenset())

    def clone(self) -> Model:
        other = Model.__new__(Model)
        other.vc = {s: dict(c) for s, c in self.vc.items()}
        other.host = dict(self.host)
        other.events = {e: (None if c is None else dict(c)) for e, c in self.events.items()}
        other.dev = [None if b is None else b.clone() for b in self.dev]
        other.hst = [b.clone() for b in self.hst]
        other.pinned = list(self.pinned)
        other.part = self.part
        other.cc = self.cc
        other.jobs = dict(self.jobs)
        other.job_count = dict(self.job_count)
        other.event_jobs = dict(self.event_jobs)
        return other

    def _cover(self, jobs) -> None:
        for job in list(jobs):
            self.jobs.pop(job, None)

    def _new_job(self, s: str) -> tuple:
        self.job_count[s] += 1
        job = (s, self.job_count[s])
        self.jobs[job] = s
        return ("job", job)

    # ordering predicates
    def _stream_sees(self, s: str, prior: tuple) -> bool:
        who, tick = prior
        if who == "job":
            return tick not in self.jobs
        return who == "host" or self.vc[s].get(who, 0) >= tick or self.host.get(who, 0) >= tick

    def _host_sees(self, prior: tuple) -> bool:
        who, tick = prior
        if who == "job":
            return tick not in self.jobs
        return who == "host" or self.host.get(who, 0) >= tick

    def _need(self, ctx: str, prior: tuple) -> tuple | None:
        if prior[0] == "job":  # a pending offloaded write: only a covering call orders anything after it
            return None if prior[1] not in self.jobs else ("job", prior[1])
        if ctx == "host":
            return None if self._host_sees(prior) else ("host", prior[0], prior[1])
        return None if self._stream_sees(ctx, prior) else ("stream", ctx, prior[0], prior[1])

    def _check(self, ctx: str, buf: _Buf, writes: bool, needs: list) -> None:
        priors = [buf.write] if buf.write is not None else []
        if writes:
            priors += buf.reads
        for prior in priors:
            need = self._need(ctx, prior)
            if need is not None and need not in needs:
                needs.append(need)

    def _tick(self, s: str) -> tuple:
        clock = self.vc[s]
        clock[s] = clock.get(s, 0) + 1
        return (s, clock[s])

    @staticmethod
    def _access(buf: _Buf, at: tuple, writes: bool) -> None:
        if writes:
            buf.write, buf.reads = at, []
        else:
            buf.reads.append(at)
        if at[0] not in ("host", "job"):
            buf.used_on[at[0]] = at[1]

    def _sync_host(self, clock: dict) -> None:
        for k, v in clock.items():
            if self.host.get(k, 0) < v:
                self.host[k] = v

    def _dev(self, i: int) -> _Buf:
        buf = self.dev[i]
        if buf is None:
            raise Illegal(f"device slot {i} is empty", [])
        return buf

    # the one entry point
    def apply(self, op: Op) -> None:
        """Apply ``op`` to the state, or raise :class:`Illegal` (the state is then unchanged).

        Each kind checks before it changes anything; only THREAD and CONCURRENT blocks, several ops, need a snapshot.
        """
        if op.kind not in ("THREAD", "CONCURRENT"):
            self._apply(op)
            return
        snapshot = self.clone()
        try:
            self._apply(op)
        except Illegal:
            self.__dict__.update(snapshot.__dict__)
            raise

    def _apply(self, op: Op) -> None:  # noqa: C901 - one branch per kind, kept together to read as one table
        k, a = op.kind, op.args
        needs: list = []
        if k == "THREAD":
            for inner in op.body:
                self._apply(inner)
            return
        if k == "CONCURRENT":
            self._apply_concurrent(op)
            return
        if k == "SLEEP":
            self._tick(a[0])
        elif k in ("KERNEL", "FILL"):  # (s, g, view, ...): KERNEL reads and writes, FILL writes
            s, g = a[0], a[1]
            buf = self._dev(g)
            self._check(s, buf, True, needs)
            self._raise(needs, op)
            self._access(buf, self._tick(s), True)
        elif k == "H2D":  # (s, h, hview, g, gview, nb[, via]): via only spells a blocking copy differently
            s, h, hview, g, gview, nb = a[:6]
            hb, gb = self.hst[h], self._dev(g)
            if gb.registered:
                self._check("host", gb, True, needs)  # the in-place promise: nothing touches the target now
            # torch reads a non-contiguous host source, or one it converts for a blocking copy, on the host when
            # the call is made (it makes a contiguous or converted copy first); otherwise the copy reads h in s's
            # order (a blocking one too).
            reads_now = h2d_reads_host_now(hview, gview, nb, hb.dtype, gb.dtype)
            # cc: the shim reads a non_blocking H2D's source at the call (staged), CC without it by the call's return
            reads_now = reads_now or (self.cc and nb)
            self._check("host" if reads_now else s, hb, False, needs)
            self._check(s, gb, True, needs)
            self._raise(needs, op)
            at = self._tick(s)
            self._access(hb, at if nb and not reads_now else ("host", 0), False)
            self._access(gb, at, True)
        elif k == "H2D_FRESH":  # (s, h, g, nb, form, dtype, host view)
            s, h, g, nb = a[0], a[1], a[2], a[3]
            if self.dev[g] is not None:
                raise Illegal(f"device slot {g} is in use", [])
            hb = self.hst[h]
            hv = a[6]
            reads_now = h2d_reads_host_now(hv, fresh_result_view(hv, a[4]), nb, hb.dtype, a[5] or hb.dtype)
            reads_now = reads_now or (self.cc and nb)  # as for H2D
            self._check("host" if reads_now else s, hb, False, needs)
            self._raise(needs, op)
            at = self._tick(s)
            self._access(hb, at if nb and not reads_now else ("host", 0), False)
            dtype = a[5] or hb.dtype
            self.dev[g] = _Buf(write=at, alloc=s, used_on={s: at[1]}, dtype=dtype)
        elif k == "D2H":  # (s, g, gview, h, hview, nb[, via])
            s, g, _, h, _, nb = a[:6]
            gb, hb = self._dev(g), self.hst[h]
            self._check(s, gb, False, needs)
            self._check(s, hb, True, needs)
            self._raise(needs, op)
            at = self._tick(s)
            self._access(gb, at, False)
            if nb and self.cc and s.startswith("D"):
                self._access(hb, self._new_job(s), True)  # maybe offloaded: done only once covered
            elif nb and not self.cc:
                self._access(hb, at, True)
            else:  # torch: cudaMemcpyAsync then cudaStreamSynchronize of s (cc: CC's copy drains s the same way)
                self._sync_host(self.vc[s])
                self._access(hb, ("host", 0), True)
        elif k == "BLOCKING_READ":  # (s, g, form): dev[g].cpu() / .item() / .tolist() with s current
            s, g = a[0], a[1]
            gb = self._dev(g)
            self._check(s, gb, False, needs)
            self._raise(needs, op)
            at = self._tick(s)
            self._access(gb, at, False)
            self._sync_host(self.vc[s])  # torch returns once s has reached the read: all of s before it is done
        elif k == "D2H_FRESH":  # (s, g, h, nb, dtype[, source view])
            s, g, h, nb, dtype = a[:5]
            view = a[5] if len(a) > 5 else ("full",)
            gb, hb = self._dev(g), self.hst[h]
            self._check(s, gb, False, needs)
            self._check("host", hb, True, needs)  # the old host tensor is dropped: let nothing use it still
            self._raise(needs, op)
            at = self._tick(s)
            self._access(gb, at, False)
            new = _Buf(dtype=dtype or gb.dtype)
            if nb and self.cc and s.startswith("D") and not d2h_fresh_fills_on_host(view, nb, gb.dtype, dtype):
                self._access(new, self._new_job(s), True)
            elif nb and not self.cc and not d2h_fresh_fills_on_host(view, nb, gb.dtype, dtype):
                self._access(new, at, True)
            elif nb and not self.cc:
                new.write = ("host", 0)  # torch fills it on the host before returning (its stream is not drained)
            else:
                self._sync_host(self.vc[s])
                new.write = ("host", 0)
            self.hst[h] = new
            self.pinned[h] = bool(nb)
        elif k == "D2D":  # (s, g1, v1, g2, v2, nb)
            s, g1, _, g2, _, _ = a
            if g1 == g2:
                raise Illegal("a copy within one buffer", [])
            b1, b2 = self._dev(g1), self._dev(g2)
            self._check(s, b1, False, needs)
            self._check(s, b2, True, needs)
            self._raise(needs, op)
            at = self._tick(s)
            self._access(b1, at, False)
            self._access(b2, at, True)
        elif k == "WAIT_STREAM":  # (a, b)
            waiter, producer = a
            for key, v in self.vc[producer].items():
                if self.vc[waiter].get(key, 0) < v:
                    self.vc[waiter][key] = v
            self._cover(self.jobs)  # it records an event on b now and waits on it: that covers every job so far
        elif k == "RECORD":  # (e, s, form)
            self.events[a[0]] = dict(self.vc[a[1]])
            self.event_jobs[a[0]] = frozenset(self.jobs)  # the any-event rule: it covers every job so far
        elif k == "WAIT_EVENT":  # (s, e, form)
            clock = self.events[a[1]]
            if clock is None:
                raise Illegal("waiting for an event never recorded", [])
            for key, v in clock.items():
                if self.vc[a[0]].get(key, 0) < v:
                    self.vc[a[0]][key] = v
            self._cover(self.event_jobs[a[1]])
        elif k in ("EVENT_SYNC", "EVENT_SPIN"):  # (e,)
            clock = self.events[a[0]]
            if clock is None:
                raise Illegal("synchronizing an event never recorded", [])
            self._sync_host(clock)
            self._cover(self.event_jobs[a[0]])
        elif k == "EVENT_QUERY":
            pass
        elif k == "STREAM_SYNC":  # (s,)
            self._sync_host(self.vc[a[0]])
            # an ordinary stream's synchronize covers every job; a D2H stream's, its own
            self._cover([j for j, d in self.jobs.items() if d == a[0] or not a[0].startswith("D")])
        elif k == "DEVICE_SYNC":  # (form,)
            for s in STREAMS:
                self._sync_host(self.vc[s])
            self._cover(self.jobs)
        elif k == "HOST_READ":  # (h, view)
            self._check("host", self.hst[a[0]], False, needs)
            self._raise(needs, op)
        elif k == "HOST_WRITE":  # (h, view, pattern)
            hb = self.hst[a[0]]
            self._check("host", hb, True, needs)
            self._raise(needs, op)
            self._access(hb, ("host", 0), True)
        elif k == "RECORD_STREAM":  # (g, s)
            self._dev(a[0]).recorded.add(a[1])
        elif k == "FREE":  # (g,)
            # The caching allocator hands the block to later allocations on the allocation stream: every use on
            # another stream must be finished, ordered before that stream's later work, or record_stream'ed.
            buf = self._dev(a[0])
            for who, tick in buf.used_on.items():
                if who == buf.alloc or who in buf.recorded or self.host.get(who, 0) >= tick:
                    continue
                if buf.alloc != INIT and self.vc[buf.alloc].get(who, 0) >= tick:
                    continue
                need = ("free", a[0], who, tick)
                if need not in needs:
                    needs.append(need)
            self._raise(needs, op)
            self.dev[a[0]] = None
        elif k == "ALLOC":  # (s, g, dtype, value)
            s, g, dtype = a[0], a[1], a[2]
            if self.dev[g] is not None:
                raise Illegal(f"device slot {g} is in use", [])
            at = self._tick(s)
            self.dev[g] = _Buf(write=at, alloc=s, used_on={s: at[1]}, dtype=dtype)
        elif k == "REGISTER":  # (g, s)
            self._dev(a[0]).registered = True
        else:
            raise ValueError(f"unknown op kind {k!r}")

    def _apply_concurrent(self, op: Op) -> None:
        """Two bodies run at once on two threads: each must be legal alone, from this state, on its own part.

        Since they share no stream, buffer or event, any interleaving gives the same results; afterwards the
        host knows what either body synchronized.
        """
        if len(op.body) != len(PARTS):
            raise Illegal("a CONCURRENT block has one body per part", [])
        results = []
        for part, body in zip(PARTS, op.body):
            if not within(body, part):
                raise Illegal(f"a concurrent body leaves its part: {body}", [])
            trial = self.clone()
            trial._apply(body)
            results.append(trial)
        host = dict(self.host)
        for part, trial in zip(PARTS, results):
            for s in part["streams"]:
                self.vc[s] = trial.vc[s]
            for i in part["dev"]:
                self.dev[i] = trial.dev[i]
            for i in part["host"]:
                self.hst[i], self.pinned[i] = trial.hst[i], trial.pinned[i]
            for e in part["events"]:
                self.events[e] = trial.events[e]
                self.event_jobs[e] = trial.event_jobs[e]
            for s in part["streams"]:
                self.job_count[s] = trial.job_count[s]
            for k, v in trial.host.items():
                host[k] = max(host.get(k, 0), v)
        self.host = host
        # A job from before stays uncovered unless a body covered it; a body's own jobs stay as it left them.
        before = self.jobs
        jobs = {}
        for trial in results:
            for job, d in trial.jobs.items():
                if job not in before or all(job in other.jobs for other in results):
                    jobs[job] = d
        self.jobs = jobs

    @staticmethod
    def _raise(needs: list, op: Op) -> None:
        if needs:
            raise Illegal(f"{op} is not ordered: {needs}", needs)


def is_legal(spec: ProgramSpec) -> bool:
    """Return whether every op of ``spec`` is correct under plain torch, in order, from the initial state."""
    model = Model(spec)
    try:
        for op in spec.ops:
            model.apply(op)
    except Illegal:
        return False
    return True


# -- the minimizer --------------------------------------------------------------------------------------------

def minimize(spec: ProgramSpec, still_fails: Callable[[ProgramSpec], bool], max_tries: int = 400) -> ProgramSpec:
    """Drop ops (chunks, then one by one) while the program stays legal and ``still_fails``; return the smallest."""
    ops = list(spec.ops)
    tries = 0
    chunk = max(1, len(ops) // 2)
    while chunk >= 1 and tries < max_tries:
        i, changed = 0, False
        while i < len(ops) and tries < max_tries:
            candidate = spec.copy_with(ops[:i] + ops[i + chunk:])
            if candidate.ops and is_legal(candidate):
                tries += 1
                if still_fails(candidate):
                    ops, changed = candidate.ops, True
                    continue
            i += chunk
        if not changed:
            chunk //= 2
    # A THREAD block that still matters: try its ops inline (the failure may not need the second thread).
    for i, op in enumerate(list(ops)):
        if op.kind == "THREAD" and tries < max_tries:
            candidate = spec.copy_with(ops[:i] + list(op.body) + ops[i + 1:])
            if is_legal(candidate):
                tries += 1
                if still_fails(candidate):
                    ops = candidate.ops
    return spec.copy_with(ops)


# -- running on torch -----------------------------------------------------------------------------------------

def count_copies(ops: Sequence[Op]) -> int:
    n = 0
    for op in ops:
        if op.kind in ("THREAD", "CONCURRENT"):
            n += count_copies(op.body)
        elif op.kind in ("H2D", "H2D_FRESH", "D2H", "D2H_FRESH", "D2D"):
            n += 1
    return n

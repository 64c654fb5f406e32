"""The cc fuzzer's program generator: random programs that the model (``cc_fuzz.Model``) accepts, from a seed.

Each step proposes an operation from a weighted table; if the model forbids
it, the generator inserts one of torch's ways to order it (a ``wait_stream``,
an event record and wait, a synchronize, a ``record_stream``) and tries
again, or drops it. Half the programs are generated for the plain-torch
oracle, half for the cc oracle (CC without the shim: ``Model``'s ``cc``
rules). A few programs get long sleeps, to open race windows
wide; some get blocks on a second host thread, or two threads at once.
"""

from __future__ import annotations

import random

from cc_fuzz import (
    DTYPES,
    FRESH_FORMS,
    INIT,
    LONG_SLEEP,
    N_DEV,
    N_EVENTS,
    N_HOST,
    PARTS,
    SHORT_SLEEPS,
    STREAMS,
    Illegal,
    Model,
    Op,
    ProgramSpec,
    random_view_pair,
)


class Generator:
    """Random legal programs, reproducible from a seed."""

    def __init__(self, seed: int, n_ops: tuple[int, int] = (10, 32), oracle: str | None = None):
        self.seed = seed
        self.rng = random.Random(seed)
        self.n_ops = n_ops
        self.long_sleeps = self.rng.random() < 0.03
        # Half the programs are correct for each oracle (a stream of its own, so a seed's draw stays the same).
        self.oracle = oracle or ("cc" if random.Random(seed * 7919 + 17).random() < CC_SHARE else "torch")

    def program(self) -> ProgramSpec:
        rng = self.rng
        spec = ProgramSpec(
            seed=self.seed,
            host_pinned=tuple(rng.random() < 0.7 for _ in range(N_HOST)),
            host_dtypes=tuple(rng.choice(DTYPES) for _ in range(N_HOST)),
            dev_dtypes=tuple(rng.choice(DTYPES) for _ in range(N_DEV)),
            oracle=self.oracle,
        )
        model = Model(spec)
        target = rng.randint(*self.n_ops)
        ops: list[Op] = []
        attempts = 0
        while len(ops) < target and attempts < target * 6:
            attempts += 1
            if rng.random() < 0.05 and len(ops) + 3 < target:
                sub = self._thread_block(model)
                if sub is not None:
                    ops.append(sub)
                continue
            if rng.random() < 0.04 and len(ops) + 6 < target:
                ops.extend(self._concurrent_block(model))
                continue
            ops.extend(self._legal_step(model))
        # End state: nothing is left unsynchronized (the runner reads every buffer after a device synchronize).
        ops.append(Op("DEVICE_SYNC", (0,)))
        model.apply(ops[-1])
        spec.ops = ops
        return spec

    def _thread_block(self, model: Model) -> Op | None:
        trial = model.clone()
        body: list[Op] = []
        for _ in range(self.rng.randint(1, 4)):
            body.extend(self._legal_step(trial))
        if not body:
            return None
        op = Op("THREAD", (), tuple(body))
        model.apply(op)
        return op

    def _concurrent_block(self, model: Model) -> list[Op]:
        """A device synchronize, then two bodies on disjoint resources, run by two host threads at once."""
        sync = Op("DEVICE_SYNC", (0,))
        model.apply(sync)  # so no body needs an ordering on the other body's streams
        bodies = []
        for part in PARTS:
            trial = model.clone()
            trial.part = part
            body: list[Op] = []
            for _ in range(self.rng.randint(2, 6)):
                body.extend(self._legal_step(trial))
            bodies.append(Op("THREAD", (), tuple(body)))
        op = Op("CONCURRENT", (), tuple(bodies))
        model.apply(op)
        return [sync, op]

    def _legal_step(self, model: Model) -> list[Op]:
        """Propose one op; make it legal with up to three inserted orderings; return the ops added (maybe none)."""
        op = self._propose(model)
        if op is None:
            return []
        added: list[Op] = []
        for _ in range(4):
            try:
                model.apply(op)
                return added + [op]
            except Illegal as err:
                if not err.needs:
                    return added
                fix = self._fix(model, err.needs[0])
                if fix is None:
                    return added
                for f in fix:
                    model.apply(f)
                added.extend(fix)
        return added

    def _fix(self, model: Model, need: tuple) -> list[Op] | None:
        """Return ops that provide ``need`` (an ordering the model asked for), chosen at random among torch's ways."""
        rng = self.rng
        if need[0] == "stream":
            _, s, p, _ = need
            roll = rng.random()
            if p == INIT or roll < 0.2:
                return self._host_sync_for(p, model)
            if roll < 0.6:
                return [Op("WAIT_STREAM", (s, p))]
            e = self._event(model)
            return [Op("RECORD", (e, p, rng.randrange(3))), Op("WAIT_EVENT", (s, e, rng.randrange(3)))]
        if need[0] == "host":
            return self._host_sync_for(need[1], model)
        if need[0] == "job":
            return self._cover_job(need[1], model)
        if need[0] == "free":
            _, g, who, _ = need
            if who != INIT and rng.random() < 0.7:
                return [Op("RECORD_STREAM", (g, who))]
            return self._host_sync_for(who, model)
        return None

    def _cover_job(self, job: tuple, model: Model) -> list[Op]:
        """Ops that cover offloaded job ``job`` (its D2H stream, its number) by the seed's rule (cc oracle only)."""
        rng = self.rng
        streams = model.part["streams"] if model.part else STREAMS
        d = job[0]
        roll = rng.random()
        if roll < 0.1:
            return [Op("DEVICE_SYNC", (rng.randrange(2),))]
        if roll < 0.25:
            return [Op("STREAM_SYNC", (rng.choice([d] + [x for x in streams if not x.startswith("D")]),))]
        if roll < 0.4:
            a, b = rng.sample(list(streams), 2)
            return [Op("WAIT_STREAM", (a, b))]
        e = self._event(model)
        record = Op("RECORD", (e, rng.choice(streams), rng.randrange(3)))  # on any stream: the any-event rule
        if roll < 0.55:
            return [record, Op("WAIT_EVENT", (rng.choice(streams), e, rng.randrange(3)))]
        ops = [record, Op("EVENT_SPIN" if rng.random() < 0.3 else "EVENT_SYNC", (e,))]
        if rng.random() < 0.1:
            return [Op("THREAD", (), tuple(ops))]
        return ops

    def _event(self, model: Model) -> int:
        return self.rng.choice(model.part["events"]) if model.part else self.rng.randrange(N_EVENTS)

    def _host_sync_for(self, p: str, model: Model) -> list[Op]:
        """Ops after which the host knows that stream ``p``'s work so far has finished."""
        rng = self.rng
        roll = rng.random()
        if p == INIT or roll < 0.3:
            return [Op("DEVICE_SYNC", (rng.randrange(2),))] if p == INIT or roll < 0.1 else [Op("STREAM_SYNC", (p,))]
        e = self._event(model)
        ops = (Op("RECORD", (e, p, rng.randrange(3))), Op("EVENT_SPIN" if rng.random() < 0.3 else "EVENT_SYNC", (e,)))
        if rng.random() < 0.1:  # the wait happens on the second host thread
            return [Op("THREAD", (), ops)]
        return list(ops)

    def _via(self, nb: bool, host_view: tuple, dev_view: tuple, host_dtype: str, dev_dtype: str) -> str:
        """How a host<->device copy is spelled: ``copy_``, or a blocking copy that bypasses the wrappers (issue 27
        item 1): ``dst[...] = src`` (``Tensor.__setitem__``), or ``UntypedStorage.copy_`` of whole buffers of one
        dtype."""
        if nb or self.rng.random() < 0.7:
            return "copy_"
        if host_view == dev_view == ("full",) and host_dtype == dev_dtype and self.rng.random() < 0.5:
            return "storage"
        return "setitem"

    def _sleep_cycles(self) -> int:
        if self.long_sleeps and self.rng.random() < 0.3:
            return LONG_SLEEP
        return self.rng.choice(SHORT_SLEEPS)

    def _propose(self, model: Model) -> Op | None:  # noqa: C901 - a weighted table of op kinds
        rng = self.rng
        part = model.part or {"streams": STREAMS, "dev": range(N_DEV), "host": range(N_HOST),
                              "events": range(N_EVENTS)}
        streams, events = part["streams"], part["events"]
        d2h_streams = [x for x in ("D2", "D3") if x in streams]
        s = rng.choice(streams)
        live = [i for i in part["dev"] if model.dev[i] is not None]
        empty = [i for i in part["dev"] if model.dev[i] is None]
        h = rng.choice(part["host"])
        roll = rng.random()
        if roll < 0.10:
            return Op("SLEEP", (s, self._sleep_cycles()))
        # Kernels (and allocations, whose zero-fill is one) go on any stream, D2H streams too: torch orders a kernel
        # on a D2H stream after the copies queued there before it, and an offloaded copy must read its source first.
        plain = list(streams)
        if roll < 0.18 and live:
            g = rng.choice(live)
            view, _ = random_view_pair(rng)
            return Op("KERNEL", (rng.choice(plain), g, view, rng.randrange(4), self._sleep_cycles()))
        if roll < 0.22 and live:
            g = rng.choice(live)
            view, _ = random_view_pair(rng)
            return Op("FILL", (rng.choice(plain), g, view, rng.randint(-100, 100)))
        if roll < 0.36 and live:
            gv, hv = random_view_pair(rng)
            g = rng.choice(live)
            nb = rng.random() < 0.8
            return Op("H2D", (s, h, hv, g, gv, nb, self._via(nb, hv, gv, model.hst[h].dtype, model.dev[g].dtype)))
        if roll < 0.42 and empty:
            dtype = rng.choice((None, None) + DTYPES)
            hv = ("t",) if rng.random() < 0.3 else ("full",)
            return Op("H2D_FRESH", (s, h, rng.choice(empty), rng.random() < 0.8, rng.randrange(FRESH_FORMS), dtype,
                                    hv))
        if roll < 0.58 and live:
            hv, gv = random_view_pair(rng)
            # Mostly on D2H streams: that is where the worker takes the copy.
            s2 = rng.choice(d2h_streams) if rng.random() < 0.7 else s
            g = rng.choice(live)
            nb = rng.random() < 0.85
            return Op("D2H", (s2, g, gv, h, hv, nb, self._via(nb, hv, gv, model.hst[h].dtype, model.dev[g].dtype)))
        if roll < 0.63 and live:
            s2 = rng.choice(d2h_streams) if rng.random() < 0.7 else s
            # A transposed source with another dtype: torch fills the result on the host (issue 27 item 2).
            view = ("t",) if rng.random() < 0.3 else ("full",)
            return Op("D2H_FRESH", (s2, rng.choice(live), h, rng.random() < 0.85, rng.choice((None, None) + DTYPES),
                                    view))
        if roll < 0.68 and len(live) >= 2:
            g1, g2 = rng.sample(live, 2)
            v2, v1 = random_view_pair(rng)
            return Op("D2D", (s, g1, v1, g2, v2, rng.random() < 0.5))
        if roll < 0.74:
            a, b = rng.sample(list(streams), 2)
            return Op("WAIT_STREAM", (a, b))
        if roll < 0.79:
            return Op("RECORD", (rng.choice(events), s, rng.randrange(3)))
        if roll < 0.83:
            recorded = [e for e in events if model.events[e] is not None]
            return Op("WAIT_EVENT", (s, rng.choice(recorded), rng.randrange(3))) if recorded else None
        if roll < 0.86:
            recorded = [e for e in events if model.events[e] is not None]
            if not recorded:
                return None
            return Op(rng.choice(("EVENT_SYNC", "EVENT_SPIN", "EVENT_QUERY")), (rng.choice(recorded),))
        if roll < 0.88:
            if live and rng.random() < 0.35:  # a host-blocking read on s: it synchronizes s as well
                return Op("BLOCKING_READ", (s, rng.choice(live), rng.randrange(3)))
            return Op("STREAM_SYNC", (s,)) if rng.random() < 0.7 else Op("DEVICE_SYNC", (rng.randrange(2),))
        if roll < 0.93:
            hv, _ = random_view_pair(rng)
            return Op("HOST_READ", (h, hv))
        if roll < 0.95:
            hv, _ = random_view_pair(rng)
            return Op("HOST_WRITE", (h, hv, rng.randrange(4)))
        if roll < 0.975 and live:
            return Op("FREE", (rng.choice(live),))
        if roll < 0.99 and empty:
            return Op("ALLOC", (rng.choice(plain), rng.choice(empty), rng.choice(DTYPES), rng.randint(-100, 100)))
        if live:
            return Op("REGISTER", (rng.choice(live), s))
        return None


CC_SHARE = 0.5  # the share of programs generated for the cc oracle


def program_for(seed: int, n_ops: tuple[int, int] = (10, 32), oracle: str | None = None) -> ProgramSpec:
    """The program of ``seed`` (the same on every machine and Python of the same version).

    ``oracle``: "torch" or "cc" forces the oracle it is generated for (None: the seed decides, half each).
    """
    return Generator(seed, n_ops, oracle).program()

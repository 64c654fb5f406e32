"""Sustained bandwidth, host CPU per call and one-way latency: raw peer copy, NCCL and ours (both depths).

Every timed loop follows one recipe so the three methods are comparable:

* the sending rank first holds its stream with a :class:`Gate` (a GPU sleep),
  then enqueues the whole loop, so the whole loop is queued ahead of the GPU
  (ours keeps at most ``depth`` steps in flight on the link) and the GPU, not
  the host, sets the pace;
* the time comes from CUDA events on the GPU that sees the data land (the
  receiver for bandwidth, rank 0 for the ping-pong), never from the host;
* a loop whose host did not get ahead of the GPU is flagged (and the gate is
  doubled for the next repeat);
* the data are fresh pseudo-random values, checked bit for bit at the end.

Stream ordering, bandwidth loop (ours; NCCL is the same with its own stream)::

    rank 0  current: [gate sleep](ready 1)(ready 2)(ready 3)...
    rank 0  relay:   (wait ready 1)[copy 1 -> full=1](wait ready 2)[copy 2 -> full=2][wait empty>=1]
                     (wait ready 3)[copy 3 -> full=3]...
    rank 1  current: [wait full>=1][slot -> persistent 1]^first [wait full>=2][slot -> persistent 2] ...
                     [slot -> persistent K]^last

(The transport runs a depth >= 1 step on its relay stream, fenced to the
caller's stream by events: see ``syncless.pp._copy_engine``.)

``first`` and ``last`` fire when step 1 and step K have landed on rank 1:
``(K - 1) * payload / (last - first)`` is the steady-state rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from syncless.bench._pp_cuda import memcpy_async, wait_flag, write_flag
from syncless.bench._pp_plan import OWN_STREAM, rows_for, size_label
from syncless.bench._pp_rig import (
    GateTuner,
    Rig,
    empty_payload,
    make_payload,
    mean,
    median,
    nccl_recv,
    nccl_send,
    pattern,
    poison,
    same_bits,
    views,
    wait_all,
)

NAN = float("nan")
# How far a gate may grow (times its first length) when the host was not ahead.
# A host can also stop early because the GPU's launch queue is full; then the
# GPU is busy anyway, and a longer gate would only waste time.
BANDWIDTH_GATE_GROWTH = 4.0
LATENCY_GATE_GROWTH = 8.0


def gbps(nbytes: int, count: int, elapsed_ms: float) -> float:
    """Return ``count`` transfers of ``nbytes`` over ``elapsed_ms`` in GB/s (10^9 bytes per second)."""
    if count <= 0 or not elapsed_ms > 0:
        return NAN
    return nbytes * count / (elapsed_ms * 1e6)


def _timing_events(count: int) -> list[Any]:
    import torch

    return [torch.cuda.Event(enable_timing=True) for _ in range(count)]


def _cpu_record(thread_s: list[float], process_s_per_step: list[float]) -> dict[str, float]:
    return {
        "thread_us": mean(thread_s) * 1e6,
        "thread_us_median": median(thread_s) * 1e6,
        "process_us_per_step": mean(process_s_per_step) * 1e6,
        "calls": len(thread_s),
    }


def _payload_check(rows: int, seed: int, device: Any) -> Callable[[Any], bool]:
    """Return a check that a received payload is ``make_payload(rows, seed, device)`` bit for bit.

    The expected payload is regenerated only when the check runs (it synchronizes the host).
    """

    def check(out: Any) -> bool:
        return same_bits(out, make_payload(rows, seed, device))

    return check


def _raw_landed_equals(rig: Rig, nbytes: int, expected: Any, what: str) -> bool:
    """Return whether the ``nbytes`` in this rank's raw buffer equal ``expected`` (int16), bit for bit.

    Copies them out on the current stream, then waits for the GPU (blocks the host).
    """
    import torch

    landed = torch.empty(nbytes // 2, dtype=torch.int16, device=rig.device)
    memcpy_async(landed.data_ptr(), rig.raw.local_data, nbytes, torch.cuda.current_stream())
    rig.sync(what)
    return bool(torch.equal(landed, expected))


# Bandwidth -------------------------------------------------------------------------


def run_bandwidth(rig: Rig) -> dict[str, dict[int, float]]:
    """Measure every payload with each method; return ``{method: {nbytes: GB/s}}`` on both ranks.

    The methods: the raw peer copy, NCCL, ours (default depth), ours with depth=0 and ours with depth="auto".
    """
    measured: dict[str, dict[int, float]] = {"raw": {}, "nccl": {}, "ours": {}, "ours_depth0": {}, "ours_auto": {}}
    for index, nbytes in enumerate(rig.plan.payloads):
        seed = 100 + 10 * index
        mine = {
            "raw": bandwidth_raw(rig, nbytes, seed),
            "nccl": bandwidth_nccl(rig, nbytes, seed + 1),
            "ours": bandwidth_ours(rig, nbytes, seed + 2) if rig.fwd is not None else NAN,
            "ours_depth0": bandwidth_ours(rig, nbytes, seed + 3, "fwd0") if rig.fwd0 is not None else NAN,
            "ours_auto": bandwidth_ours(rig, nbytes, seed + 4, "fwda") if rig.fwda is not None else NAN,
        }
        rank0, rank1 = rig.gather(mine)
        row = {"raw": rank0["raw"], "nccl": rank1["nccl"], "ours": rank1["ours"], "ours_depth0": rank1["ours_depth0"],
               "ours_auto": rank1["ours_auto"]}
        for method, value in row.items():
            measured[method][nbytes] = value
        if rig.sender:
            rig.report.progress(
                f"bandwidth {size_label(nbytes)}: raw peer copy {row['raw']:.1f}, NCCL {row['nccl']:.1f}, "
                f"ours {row['ours']:.1f}, ours depth=0 {row['ours_depth0']:.1f}, ours auto {row['ours_auto']:.1f} GB/s"
            )
    return measured


def bandwidth_raw(rig: Rig, nbytes: int, seed: int) -> float:
    """Rank 0 copies ``nbytes`` into rank 1's IPC-opened buffer with ``cuMemcpyAsync``, back to back.

    Returns GB/s on rank 0, NaN on rank 1 (which checks the bytes that landed).
    """
    import torch

    plan = rig.plan
    if rig.raw is None:
        return NAN
    steps = plan.steps_for(nbytes)
    stream = torch.cuda.current_stream()
    if not rig.sender:  # poison the landing zone so that the check below can fail
        junk = torch.full((nbytes // 2,), -1, dtype=torch.int16, device=rig.device)
        memcpy_async(rig.raw.local_data, junk.data_ptr(), nbytes, stream)
        rig.sync("raw peer copy: poisoning")
    rig.barrier()
    source = pattern(nbytes // 2, seed, rig.device) if rig.sender else None
    if source is not None:
        for _ in range(plan.warmup_steps):
            memcpy_async(rig.raw.peer_data, source.data_ptr(), nbytes, stream)
        rig.sync("raw peer copy warm-up")
    tuner = GateTuner(2.0 + 0.05 * steps, BANDWIDTH_GATE_GROWTH)
    reps: list[float] = []
    aheads: list[bool] = []
    for _ in range(plan.bandwidth_reps):
        rig.barrier()
        if source is None:
            continue
        held = rig.gate.hold(tuner.ms)
        first, last = _timing_events(2)
        for step in range(steps):
            memcpy_async(rig.raw.peer_data, source.data_ptr(), nbytes, stream)
            if step == 0:
                first.record()
        last.record()
        ahead = not held.query()
        rig.sync("raw peer copy")
        reps.append(gbps(nbytes, steps - 1, first.elapsed_time(last)))
        aheads.append(ahead)
        tuner.update(ahead)
    rig.barrier()  # rank 0's copies are finished (it synchronized) before rank 1 reads them
    if source is not None:
        result = median(reps)
        rig.report.result(
            ("bandwidth", "raw", nbytes),
            {"gbps": result, "reps_gbps": reps, "steps": steps, "ahead": aheads, "gate_ms": tuner.ms},
        )
        return result
    data_ok = _raw_landed_equals(rig, nbytes, pattern(nbytes // 2, seed, rig.device), "raw peer copy: check")
    rig.report.result(("bandwidth", "raw", nbytes), {"data_ok": data_ok})
    return NAN


def _bandwidth_loop(
    rig: Rig,
    method: str,
    nbytes: int,
    send_one: Callable[[], None],
    recv_one: Callable[[], Any],
    before_rep: Callable[[], None],
    check: Callable[[Any], bool],
    initial_gate_ms: float,
) -> float:
    """The shared bandwidth recipe for NCCL and ours; returns GB/s on rank 1, NaN on rank 0."""
    plan = rig.plan
    steps = plan.steps_for(nbytes)
    for _ in range(plan.warmup_steps):
        if rig.sender:
            send_one()
        else:
            recv_one()
    rig.sync(f"{method} warm-up")
    tuner = GateTuner(initial_gate_ms, BANDWIDTH_GATE_GROWTH)
    reps: list[float] = []
    aheads: list[bool] = []
    thread_s: list[float] = []
    process_s: list[float] = []
    last_out: Any = None
    for _ in range(plan.bandwidth_reps):
        if not rig.sender:
            before_rep()
        rig.barrier()
        first = last = None
        process_start = time.process_time()
        if rig.sender:
            held = rig.gate.hold(tuner.ms)
            for _ in range(steps):
                start = time.thread_time()
                send_one()
                thread_s.append(time.thread_time() - start)
            process_s.append((time.process_time() - process_start) / steps)
            ahead = not held.query()  # the gate still held the GPU when the host was done
        else:
            first, last = _timing_events(2)
            for step in range(steps):
                start = time.thread_time()
                last_out = recv_one()
                thread_s.append(time.thread_time() - start)
                if step == 0:
                    first.record()
            last.record()
            process_s.append((time.process_time() - process_start) / steps)
            ahead = not first.query()  # every receive was enqueued before the first step landed
        rig.sync(f"{method} bandwidth")
        both_ahead = all(rig.gather(ahead))
        aheads.append(both_ahead)
        tuner.update(both_ahead)
        if first is not None and last is not None:
            reps.append(gbps(nbytes, steps - 1, first.elapsed_time(last)))
    direction = "send" if rig.sender else "recv"
    rig.report.result(("host_cpu", method, nbytes, direction), _cpu_record(thread_s, process_s))
    if rig.sender:
        return NAN
    result = median(reps)
    rig.report.result(
        ("bandwidth", method, nbytes),
        {
            "gbps": result,
            "reps_gbps": reps,
            "steps": steps,
            "ahead": aheads,
            "gate_ms": tuner.ms,
            "data_ok": check(last_out),
        },
    )
    return result


def bandwidth_nccl(rig: Rig, nbytes: int, seed: int) -> float:
    """torch.distributed NCCL: one batch of two ``isend`` per step; the receiver waits each batch."""
    rows = rows_for(nbytes)
    payload = make_payload(rows, seed, rig.device) if rig.sender else None
    into = None if rig.sender else empty_payload(rows, rig.device)

    def send_one() -> None:
        nccl_send(rig, payload)

    def recv_one() -> Any:
        wait_all(nccl_recv(rig, into))
        return into

    check = _payload_check(rows, seed, rig.device)
    steps = rig.plan.steps_for(nbytes)
    return _bandwidth_loop(
        rig, "nccl", nbytes, send_one, recv_one, lambda: poison(into), check, 5.0 + 0.2 * steps
    )


#: the bandwidth method of each forward transport of the rig
_FORWARD_METHODS = {"fwd": "ours", "fwd0": "ours_depth0", "fwda": "ours_auto"}


def bandwidth_ours(rig: Rig, nbytes: int, seed: int, name: str = "fwd") -> float:
    """Ours: ``transport.send`` / ``transport.recv`` of the same two tensors per step.

    ``name``: which forward transport of the rig: ``"fwd"`` (the default depth), ``"fwd0"`` (depth=0,
    straight into the receiver's persistent tensors) or ``"fwda"`` (depth="auto").
    """
    rows = rows_for(nbytes)
    payload = make_payload(rows, seed, rig.device) if rig.sender else None
    transport = getattr(rig, name)

    def send_one() -> None:
        transport.send(payload)

    def recv_one() -> Any:
        return views(transport.recv())

    def before_rep() -> None:
        poison(rig.persistent[name])

    check = _payload_check(rows, seed, rig.device)
    steps = rig.plan.steps_for(nbytes)
    method = _FORWARD_METHODS[name]
    return _bandwidth_loop(rig, method, nbytes, send_one, recv_one, before_rep, check, 10.0 + 0.5 * steps)


# Latency ---------------------------------------------------------------------------


def run_latency(rig: Rig, methods: tuple[str, ...] = ("nccl", "ours")) -> None:
    """Ping-pong one-way latency for ``methods`` at every latency payload.

    A method name may end in ``@own`` (see :data:`OWN_STREAM`): then both
    ranks run it on a stream of their own instead of the default stream.
    """
    for index, nbytes in enumerate(rig.plan.latency_payloads):
        row = {}
        for method in methods:
            base = method.removesuffix(OWN_STREAM)
            if base == "ours" and (rig.fwd is None or rig.bwd is None):
                continue
            if base == "ours_depth0" and (rig.fwd0 is None or rig.bwd0 is None):
                continue
            if base == "ours_auto" and (rig.fwda is None or rig.bwda is None):
                continue
            if base == "raw_flags" and rig.raw is None:
                continue
            row[method] = latency(rig, nbytes, 500 + 10 * index, method)
        if rig.sender:
            text = ", ".join(f"{method} {value:.1f} us" for method, value in row.items())
            rig.report.progress(f"one-way latency {size_label(nbytes)}: {text}")


def latency(rig: Rig, nbytes: int, seed: int, method: str) -> float:
    """Ping-pong ``nbytes`` between the ranks; return the one-way time in us on rank 0 (NaN on rank 1).

    Rank 0 holds its stream with a gate, enqueues every round trip, and
    times them with events; rank 1 echoes what it receives (its GPU work
    waits on rank 0's data, so it needs no gate). A repeat counts only if
    rank 0's host finished enqueuing before the gate opened. With the
    ``@own`` suffix everything (gate, events, transfers) runs on a created
    stream of each rank instead of the legacy default stream.
    """
    import torch

    own = method.endswith(OWN_STREAM)
    base = method.removesuffix(OWN_STREAM)
    if own:
        if rig.own_stream is None:
            rig.own_stream = torch.cuda.Stream(rig.device)
        with torch.cuda.stream(rig.own_stream):
            return _latency_on_current_stream(rig, nbytes, seed, method, base)
    return _latency_on_current_stream(rig, nbytes, seed, method, base)


def _latency_on_current_stream(rig: Rig, nbytes: int, seed: int, method: str, base: str) -> float:
    plan = rig.plan
    rows = rows_for(nbytes)
    iters = plan.latency_iters_for(nbytes)
    if base == "nccl":
        state: dict[str, Any] = {"x": make_payload(rows, seed, rig.device) if rig.sender else None,
                                 "bufs": [empty_payload(rows, rig.device), empty_payload(rows, rig.device)]}
        loop, initial_ms = _pingpong_nccl, 5.0 + 0.1 * iters
    elif base in ("ours", "ours_depth0", "ours_auto"):
        fwd, bwd = {"ours": (rig.fwd, rig.bwd), "ours_depth0": (rig.fwd0, rig.bwd0),
                    "ours_auto": (rig.fwda, rig.bwda)}[base]
        state = {"x": make_payload(rows, seed, rig.device) if rig.sender else None, "fwd": fwd, "bwd": bwd}
        loop, initial_ms = _pingpong_ours, 10.0 + 0.5 * iters
    elif base == "raw_flags":
        state = {"x": pattern(nbytes // 2, seed, rig.device) if rig.sender else None, "nbytes": nbytes}
        loop, initial_ms = _pingpong_raw, 2.0 + 0.05 * iters
    else:
        raise ValueError(f"method must be 'nccl', 'ours', 'ours_depth0', 'ours_auto' or 'raw_flags'; got {method!r}")
    loop(rig, state, 2)
    rig.sync(f"{method} ping-pong warm-up")
    tuner = GateTuner(initial_ms, LATENCY_GATE_GROWTH)
    good: list[float] = []
    attempts: list[dict[str, Any]] = []
    last: Any = None
    while True:
        rig.barrier()
        if rig.sender:
            held = rig.gate.hold(tuner.ms)
            start, end = _timing_events(2)
            start.record()
            last = loop(rig, state, iters)
            end.record()
            ahead = not held.query()
            rig.sync(f"{method} ping-pong")
            rtt_us = start.elapsed_time(end) * 1000.0 / iters
            attempts.append({"rtt_us": rtt_us, "ahead": ahead, "gate_ms": tuner.ms})
            if ahead:
                good.append(rtt_us)
            tuner.update(ahead)
            more = len(good) < plan.latency_reps and len(attempts) < plan.latency_reps + 4
        else:
            loop(rig, state, iters)
            rig.sync(f"{method} ping-pong")
            more = None
        if not rig.share(more, src=0):
            break
    if not rig.sender:
        return NAN
    if base == "raw_flags":
        data_ok = _raw_landed_equals(rig, nbytes, state["x"], "raw ping-pong: check")
    else:
        data_ok = same_bits(last, state["x"])
    chosen = good or [a["rtt_us"] for a in attempts]
    one_way_us = median(chosen) / 2.0
    rig.report.result(
        ("latency", method, nbytes),
        {"one_way_us": one_way_us, "rtt_us": chosen, "all_ahead": bool(good), "attempts": attempts, "data_ok": data_ok},
    )
    return one_way_us


def _pingpong_nccl(rig: Rig, state: dict[str, Any], iters: int) -> Any:
    # Both directions of the pair share torch's one NCCL stream for this peer,
    # so a receive into a buffer is ordered after the earlier send from it.
    bufs = state["bufs"]
    if rig.sender:
        current = state["x"]
        for i in range(iters):
            nccl_send(rig, current)
            current = bufs[i % 2]
            wait_all(nccl_recv(rig, current))
        return current
    for i in range(iters):
        wait_all(nccl_recv(rig, bufs[i % 2]))
        nccl_send(rig, bufs[i % 2])
    return None


def _pingpong_ours(rig: Rig, state: dict[str, Any], iters: int) -> Any:
    # The echo sends views of the persistent tensors it just received: its peer
    # copy runs on the current stream after that step landed (and, depth >= 1,
    # was copied out of its slot), and the next step lands there only after
    # that copy, so no step overwrites data still being read.
    fwd, bwd = state["fwd"], state["bwd"]
    if rig.sender:
        current = state["x"]
        for _ in range(iters):
            fwd.send(current)
            current = views(bwd.recv())
        return current
    for _ in range(iters):
        bwd.send(views(fwd.recv()))
    return None


def _pingpong_raw(rig: Rig, state: dict[str, Any], iters: int) -> Any:
    # The physical floor: a peer copy then a flag write on the peer, one stream
    # per rank; the flag write follows the copy in stream order. Both ranks
    # count flag values the same way, so the waits never need a reset.
    import torch

    stream = torch.cuda.current_stream()
    nbytes = state["nbytes"]
    raw = rig.raw
    for _ in range(iters):
        rig.flag_seq += 1
        if rig.sender:
            memcpy_async(raw.peer_data, state["x"].data_ptr(), nbytes, stream)
            write_flag(raw.peer_flag, rig.flag_seq, stream)
            wait_flag(raw.local_flag, rig.flag_seq, stream)
        else:
            wait_flag(raw.local_flag, rig.flag_seq, stream)
            memcpy_async(raw.peer_data, raw.local_data, nbytes, stream)
            write_flag(raw.peer_flag, rig.flag_seq, stream)
    return None

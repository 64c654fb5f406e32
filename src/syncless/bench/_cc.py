"""``syncless bench cc``: a decode-like loop with and without the CC shim, under emulated CC.

Four setups, measured in the same run on one GPU:

- ``plain``: no CC, no shim (the target).
- ``shim``: the shim installed without CC (its overhead).
- ``emulated``: CC emulated, no shim (what CC costs a naive loop).
- ``emulated+shim``: CC emulated with the shim (what syncless recovers).
- ``plain+events`` and ``emulated+shim+events``: the loop again, recording two
  events on the current stream each step, which the shim stamps with the
  copies they cover (the cost of the any-event rule); a third table times
  one ``Event.record()`` with and without a copy pending.

Each step uploads small ``non_blocking`` inputs (token ids, positions), runs a
few ms of GPU work (embedding, a stack of matmuls, an argmax) and reads the
sampled tokens back on a D2H stream; the host consumes a step's tokens one
step later (async scheduling). A second measurement times how long a 1 MiB
``non_blocking`` H2D takes to return to the host with 20 ms of GPU work queued,
in every setup of the same run, rounds interleaved, and on an idle GPU the
transfer alone (torch's copy and a stream synchronize, no syncless) and the
shim's path (emulated CC with the shim). One goal compares emulated CC with the shim to plain no-CC (at
most 1.5x); under CC the host must wait for the transfer itself, so a second
compares the shim's path to the transfer alone, both on an idle GPU: the
shim's own cost (staging stream, events, Python). ``tests/gpu/cc/probe_h2d_cost.py`` and
``probe_h2d_breakdown.py`` break that cost down.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from syncless._core.errors import MissingDependencyError
from syncless.bench import _cc_hostbound
from syncless.bench._report import BenchOutput, Goal

SETUPS = ("plain", "shim", "emulated", "emulated+shim")
HELPER_SETUP = "emulated+shim+d2h-helper"  # the shim with SYNCLESS_CC_D2H_HELPER=1 (docs/cc.md)
# Plain torch, then a wait for each readback's transfer: what CC costs a loop whose copies are made on its own thread
# by a shim that costs nothing itself (the most an in-process shim can reach; _cc_hostbound.decode_loop).
FLOOR_SETUP = "transfer floor"
HOST_BOUND_SETUPS = ("plain", FLOOR_SETUP, "emulated", "emulated+shim", HELPER_SETUP)  # the batch-1 loop (issue 33)
HOST_BOUND_GOAL = 0.98  # emulated CC with the shim vs plain, tokens/s
READBACK_GOAL = 1.5  # one step's token readback, host time: emulated CC with the shim vs plain
# The decode loop again, recording a torch.cuda.Event and a torch.Event on the current stream every step after the
# token readback and synchronizing the previous step's: what the any-event rule (docs/cc.md) costs a loop that
# records events, each of which then covers the offloaded copies issued before it.
EVENTS = "+events"
LOOP_SETUPS = SETUPS + ("plain" + EVENTS, "emulated+shim" + EVENTS)
H2D_GOAL_VS_PLAIN = 1.5  # emulated CC with the shim, vs no CC at all: host time for the 1 MiB H2D to return
H2D_GOAL_VS_TRANSFER = 1.5  # emulated CC with the shim, vs the transfer alone (the shim's own cost)
H2D_ROUNDS = 7
TRANSFER_ALONE = "nothing queued, no syncless: the copy, then a stream synchronize (the transfer alone)"
SHIM_IDLE = "emulated+shim, nothing queued"
# The H2D rows: (row, setup, ms of GPU work queued first, the host then waits for the stream). Each setup behind
# 20 ms of work, then two on an idle GPU: the transfer alone (torch's copy and a stream synchronize, the host
# wait CC's driver makes, with no syncless code at all), and the shim's path (the shim's own cost, like for like).
H2D_CASES = tuple((setup, setup, 20.0, False) for setup in SETUPS) + (
    (TRANSFER_ALONE, "plain", 0.0, True),
    (SHIM_IDLE, "emulated+shim", 0.0, False),
)
BATCH = 64
HIDDEN = 4096
VOCAB = 32000


def _require_gpu():
    import torch

    if not torch.cuda.is_available():
        raise MissingDependencyError(
            "syncless bench cc needs a CUDA GPU (torch.cuda.is_available() is False); run it on a machine with an "
            "NVIDIA GPU and a CUDA build of torch"
        )
    return torch


def paired_ratio(values: list[float], reference: list[float]) -> float:
    """Median over rounds of ``values[i] / reference[i]`` (the same round's reference: drift between rounds cancels)."""
    return statistics.median(v / r for v, r in zip(values, reference))


def _enter(setup: str):
    import syncless.cc as cc

    cc.uninstall()
    if setup == "shim":
        cc.install("on")  # (FLOOR_SETUP, like plain, installs nothing)
    elif setup == "emulated":
        cc.emulate()
    elif setup == "emulated+shim":
        cc.install("emulate")
    elif setup == HELPER_SETUP:
        _install_with_helper(cc)


def _install_with_helper(cc) -> None:
    """``cc.install("emulate")`` with ``SYNCLESS_CC_D2H_HELPER=1``, and wait until GPU 0's helper process is ready."""
    import os

    from syncless.cc import _helper

    before = os.environ.get("SYNCLESS_CC_D2H_HELPER")
    os.environ["SYNCLESS_CC_D2H_HELPER"] = "1"
    try:
        cc.install("emulate")
    finally:
        if before is None:
            del os.environ["SYNCLESS_CC_D2H_HELPER"]
        else:
            os.environ["SYNCLESS_CC_D2H_HELPER"] = before
    if not _helper.wait_ready(0):
        raise RuntimeError("syncless bench cc: the D2H helper process did not start (see the warning above)")


class _Model:
    """A decode step: embed the inputs, ~``target_ms`` of GPU work, sample with a small head.

    The forward pass is stood in for by one calibrated spin kernel, so the
    step is GPU-bound with a handful of launches, as a CUDA-graphed decode
    step is; a loop of many small kernels would measure Python launch speed
    instead of copies. ``step(ids, pos)`` returns token ids on the current stream.
    """

    def __init__(self, torch, dev, cycles_per_step: int):
        gen = torch.Generator(device=dev).manual_seed(0)
        self.torch = torch
        self.emb = torch.randn(VOCAB, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
        self.pos = torch.randn(4096, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
        self.out = torch.randn(HIDDEN, VOCAB, device=dev, dtype=torch.bfloat16, generator=gen) / 64
        self.cycles_per_step = cycles_per_step

    def step(self, ids, pos):
        x = self.emb[ids] + self.pos[pos]
        self.torch.cuda._sleep(self.cycles_per_step)
        return (x @ self.out).argmax(dim=-1)


def _decode_loop(torch, dev, model: _Model, d2h, steps: int, warmup: int, events: bool = False) -> float:
    """Run the loop; return tokens per second over the measured steps.

    ``events``: also record a ``torch.cuda.Event`` and a ``torch.Event`` on the current stream each step, after
    the readback, and synchronize the previous step's before consuming its tokens.
    """
    current = torch.cuda.current_stream(dev)
    next_ids = torch.randint(0, VOCAB, (BATCH,))
    pending = None  # (tokens on host, event) of the previous step
    start_s = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            if pending is not None:
                pending[1].synchronize()
            start_s = time.perf_counter()
        ids_host = torch.empty(BATCH, dtype=torch.int64, pin_memory=True)
        ids_host.copy_(next_ids)
        pos_host = torch.full((BATCH,), step % 4096, dtype=torch.int64, pin_memory=True)
        ids = ids_host.to(dev, non_blocking=True)
        pos = pos_host.to(dev, non_blocking=True)
        tokens = model.step(ids, pos)
        d2h.wait_stream(current)
        with torch.cuda.stream(d2h):
            tokens_host = tokens.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(d2h)
        marks = ()
        if events:  # on the current stream, after the readback's call: each covers that copy (docs/cc.md)
            marks = (torch.cuda.Event(), torch.Event(device=dev))
            for mark in marks:
                mark.record()
        if pending is not None:  # consume the previous step's tokens while this step runs
            for mark in pending[2]:
                mark.synchronize()
            pending[1].synchronize()
            next_ids = pending[0] % VOCAB
        pending = (tokens_host, ready, marks)
    pending[1].synchronize()
    torch.cuda.synchronize(dev)
    return BATCH * steps / (time.perf_counter() - start_s)


def _h2d_return_us(torch, dev, cycles_per_ms: int, repeats: int, queued_ms: float = 20.0,
                   then_wait: bool = False) -> list[float]:
    """Host times (us) for a 1 MiB non_blocking H2D issued behind ``queued_ms`` of queued work (0: GPU idle).

    ``then_wait``: the time includes a synchronize of the current stream after the copy call.
    """
    host = torch.randn(1 << 18).pin_memory()
    stream = torch.cuda.current_stream(dev)  # made here, not in the timed part
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(dev)
        if queued_ms:
            torch.cuda._sleep(int(cycles_per_ms * queued_ms))
        t0 = time.perf_counter()
        out = host.to(dev, non_blocking=True)
        if then_wait:
            stream.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize(dev)
        del out
    return times


def _h2d_table(torch, dev, cycles_per_ms: int, repeats: int, progress) -> dict[str, float]:
    """Median host time (us) of the 1 MiB H2D in every row of :data:`H2D_CASES`; rounds interleaved.

    The transfer alone is torch's copy and a stream synchronize on an idle
    GPU, without syncless: the host waits for the copy itself and nothing
    else, the least that any design which issues the copy on the calling
    thread can cost under CC. Host timings on a
    shared machine drift by several times within a minute
    (``tests/gpu/cc/probe_h2d_host_state.py``), so each round takes a few
    samples of every row in turn and the medians come from all rounds.
    """
    samples: dict[str, list[float]] = {row[0]: [] for row in H2D_CASES}
    per_round = max(1, repeats // H2D_ROUNDS)
    for _ in range(H2D_ROUNDS):  # interleaved, so drift hits every row alike
        for row, setup, queued_ms, then_wait in H2D_CASES:
            _enter(setup)
            samples[row] += _h2d_return_us(torch, dev, cycles_per_ms, per_round, queued_ms=queued_ms,
                                           then_wait=then_wait)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, us in medians.items():
        progress(f"1 MiB H2D, {name}: {us:,.0f} us to return")
    return medians


def _record_us(torch, dev, cycles_per_ms: int, repeats: int = 2000) -> dict[str, float]:
    """Median host time (us) of one ``torch.cuda.Event.record()`` on the current stream, per setup.

    With the shim, once with no offloaded copy pending and once with one pending (it waits behind queued GPU
    work), where the record stamps the event with the copies it covers.
    """
    import syncless.cc as cc

    out = {}
    for name, setup, pending in (("plain", "plain", False), ("shim, nothing pending", "shim", False),
                                 ("shim, a copy pending", "shim", True)):
        _enter(setup)
        events = [torch.cuda.Event() for _ in range(repeats)]
        torch.cuda.synchronize(dev)
        if pending:
            d2h = cc.new_d2h_stream(dev)
            src = torch.randn(1024, device=dev)
            with torch.cuda.stream(d2h):
                torch.cuda._sleep(cycles_per_ms * 50)
                src.to("cpu", non_blocking=True)
        times = []
        for event in events:
            t0 = time.perf_counter()
            event.record()
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize(dev)
        if pending:
            cc.close_d2h_stream(d2h)
        out[name] = statistics.median(times)
    return out


# Rounds of the host-bound rows. A round of the batch-1 loop is a fraction of a second, and on a shared host the
# speed of every call drifts by 20-30% between such spans (run 59: plain's own rounds 1,530-1,901 tokens/s, the
# floor above plain in two of seven), so many short rounds, each running every setup once in an order that rotates
# from round to round (no setup always runs first, right after the GPU idled while the previous round's figures
# were taken), give a paired median that a few long rounds do not.
HOST_BOUND_ROUNDS = 15
# The batch-1 loops each round runs per setup: name -> eager launches per step. The host-bound one is issue 33's row
# (its goal); in the GPU-paced one the host has time to spare, and a readback that does not wait at the call wins it.
HOST_BOUND_LOOP = "host-bound"
GPU_PACED_LOOP = "GPU-paced"
LOOPS = {HOST_BOUND_LOOP: _cc_hostbound.EAGER_LAUNCHES, GPU_PACED_LOOP: _cc_hostbound.GPU_PACED_LAUNCHES}


LOOP_COLUMNS = ["setup", "tokens/s (median)", "vs plain", "vs the transfer floor", "host waits at the late sync (us)",
                "host in d2h.wait_stream (us)", "min", "max"]


def rotated(setups: tuple, round_index: int) -> tuple:
    """``setups`` in round ``round_index``'s order: rotated by one place a round."""
    shift = round_index % len(setups)
    return setups[shift:] + setups[:shift]


def _host_bound_rows(torch, dev, quick: bool, rounds: int, progress):
    """The batch-1 loops of :data:`LOOPS` per setup (rounds interleaved, the order rotated) and one step's readback;
    return ``(tokens/s per loop and setup, readback us per setup, the graph's GPU us, the host's median wait at the
    late sync per loop and setup, its median time in d2h.wait_stream per loop and setup)``. ``rounds``:
    :data:`HOST_BOUND_ROUNDS` unless quick."""
    step = _cc_hostbound.build_step(torch, dev)
    graph_us = step.gpu_us()
    progress(f"host-bound loop: batch 1, CUDA graph of {graph_us:.0f} us GPU time, "
             f"{_cc_hostbound.EAGER_LAUNCHES} eager launches per step")
    steps, warmup = (100, 20) if quick else (300, 40)
    import syncless.cc as cc

    # Each loop reads back on a D2H stream of its own, as two loops of a program would: the shim chooses the way of
    # a stream's readbacks by timing its loop (._readback_choice), and one loop's choice is not the other's. (Until
    # session 21 the host-bound loop read back on the 3 ms loop's stream, and began with the way that loop's trials
    # had chosen: run 68's first two host-bound rounds were offloaded so.)
    loop_d2h = {loop: cc.new_d2h_stream(dev) for loop in LOOPS}
    rates: dict[str, dict[str, list[float]]] = {loop: {s: [] for s in HOST_BOUND_SETUPS} for loop in LOOPS}
    waits: dict[str, dict[str, list[float]]] = {loop: {s: [] for s in HOST_BOUND_SETUPS} for loop in LOOPS}
    stream_waits: dict[str, dict[str, list[float]]] = {loop: {s: [] for s in HOST_BOUND_SETUPS} for loop in LOOPS}
    for round_index in range(rounds):
        for setup in rotated(HOST_BOUND_SETUPS, round_index):
            _enter(setup)
            for loop, launches in LOOPS.items():  # the host-bound loop, then the GPU-paced one
                cc.reset_stats()
                rate = _cc_hostbound.decode_loop(torch, dev, step, loop_d2h[loop], steps, warmup,
                                                 floor=setup == FLOOR_SETUP,
                                                 waits=waits[loop][setup], launches=launches,
                                                 stream_waits=stream_waits[loop][setup])
                rates[loop][setup].append(rate)
                done = (_readbacks_done(cc, loop_d2h[loop], with_way=setup != HELPER_SETUP)
                        if setup.startswith("emulated+shim") else "")  # (the helper's copies take no way)
                progress(f"{loop} round {round_index + 1}/{rounds} {setup}: {rate:,.0f} tokens/s{done}")
    # One step's readback: another loop, on a D2H stream of its own too.
    readback_d2h = cc.new_d2h_stream(dev)
    samples: dict[str, list[float]] = {s: [] for s in HOST_BOUND_SETUPS}
    for round_index in range(rounds):  # interleaved and rotated, as the loop's rounds are
        for setup in rotated(HOST_BOUND_SETUPS, round_index):
            _enter(setup)
            samples[setup] += _cc_hostbound.readback_step_samples(torch, dev, readback_d2h,
                                                                  (200 if quick else 2400) // rounds,
                                                                  floor=setup == FLOOR_SETUP)
    readback = {setup: statistics.median(values) for setup, values in samples.items()}
    for setup, us in readback.items():
        progress(f"one step's readback, {setup}: {us:.1f} us")
    return rates, readback, graph_us, _medians(waits), _medians(stream_waits)


def _medians(per_loop: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """The median of each loop's and setup's samples."""
    return {loop: {setup: statistics.median(values) for setup, values in per_setup.items()}
            for loop, per_setup in per_loop.items()}


def _readbacks_done(cc, d2h, with_way: bool = True) -> str:
    """What the shim did with a loop's readbacks since the last ``reset_stats()``, and (``with_way``) the way its D2H
    stream's readbacks take now (:mod:`syncless.cc._readback_choice`), for the progress line."""
    from syncless.cc import _d2h

    did = cc.stats()
    record = _d2h.lookup(d2h)
    choice = getattr(record, "choice", None) if with_way else None
    way = "" if choice is None else (f", way {'offload' if choice.way else 'look'} (trials {choice.trials}, "
                                     f"switches {choice.switches}{_last_trial(choice)})")
    return f" (offloaded {did.offloaded}, read at the call {did.left_alone.get('idle_stream', 0)}{way})"


def _last_trial(choice) -> str:
    """The last trial's step per way, median / mean in microseconds, for the progress line ("" before the first)."""
    parts = [f"{'offload' if way else 'look'} {median * 1e6:.0f}/{mean * 1e6:.0f}"
             for way, (median, mean) in sorted(choice.last_trial.items())]
    return f"; last trial us median/mean: {', '.join(parts)}" if parts else ""


def _cycles_per_ms(torch) -> int:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return int(20_000_000 / max(start.elapsed_time(end), 1e-3))


def run(args: Any, progress) -> BenchOutput:
    """Measure the four setups; return tables, goals and a plot."""
    torch = _require_gpu()
    import syncless.cc as cc

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    quick = bool(getattr(args, "quick", False))
    steps, warmup, rounds = (40, 10, 2) if quick else (200, 20, 5)
    target_ms = 3.0
    cc.uninstall()
    cycles = _cycles_per_ms(torch)
    model = _Model(torch, dev, int(cycles * target_ms))
    d2h = cc.new_d2h_stream(dev)
    progress(f"model: batch {BATCH}, hidden {HIDDEN}, {target_ms} ms of GPU work per step (calibrated spin)")
    tokens_per_s: dict[str, list[float]] = {s: [] for s in LOOP_SETUPS}
    stats: dict[str, Any] = {}
    try:
        for round_index in range(rounds):
            for setup in LOOP_SETUPS:  # interleaved, so drift hits every setup alike
                _enter(setup.removesuffix(EVENTS))
                cc.reset_stats()
                rate = _decode_loop(torch, dev, model, d2h, steps, warmup, events=setup.endswith(EVENTS))
                tokens_per_s[setup].append(rate)
                stats[setup] = cc.stats().__dict__ | {"left_alone": dict(cc.stats().left_alone)}
                progress(f"round {round_index + 1}/{rounds} {setup}: {rate:,.0f} tokens/s")
        host_bound_rounds = rounds if quick else HOST_BOUND_ROUNDS
        loop_rates, readback_us, graph_us, late_sync_us, wait_stream_us = _host_bound_rows(
            torch, dev, quick, host_bound_rounds, progress)
        h2d_us = _h2d_table(torch, dev, cycles, H2D_ROUNDS if quick else 6 * H2D_ROUNDS, progress)
        record_us = _record_us(torch, dev, cycles, 200 if quick else 2000)
        for name, us in record_us.items():
            progress(f"torch.cuda.Event.record(), {name}: {us:.2f} us")
    finally:
        cc.uninstall()

    median = {s: statistics.median(v) for s, v in tokens_per_s.items()}
    plain = median["plain"]
    rows = [[s, median[s], median[s] / plain, min(tokens_per_s[s]), max(tokens_per_s[s])] for s in LOOP_SETUPS]
    record_rows = [[name, us, us / record_us["plain"]] for name, us in record_us.items()]
    h2d_rows = [[s, h2d_us[s], h2d_us[s] / h2d_us["plain"], h2d_us[s] / h2d_us["emulated"],
                 h2d_us[s] / h2d_us[TRANSFER_ALONE]] for s in h2d_us]
    vs_plain = {loop: {s: paired_ratio(r[s], r["plain"]) for s in HOST_BOUND_SETUPS} for loop, r in loop_rates.items()}
    vs_floor = {loop: {s: paired_ratio(r[s], r[FLOOR_SETUP]) for s in HOST_BOUND_SETUPS}
                for loop, r in loop_rates.items()}
    loop_rows = {loop: [[s, statistics.median(r[s]), vs_plain[loop][s], vs_floor[loop][s], late_sync_us[loop][s],
                         wait_stream_us[loop][s], min(r[s]), max(r[s])] for s in HOST_BOUND_SETUPS]
                 for loop, r in loop_rates.items()}
    host_bound, hb_vs_plain, hb_vs_floor = (loop_rates[HOST_BOUND_LOOP], vs_plain[HOST_BOUND_LOOP],
                                            vs_floor[HOST_BOUND_LOOP])
    readback_rows = [[s, us, us / readback_us["plain"], us / readback_us[FLOOR_SETUP]] for s, us in readback_us.items()]
    goals = [
        Goal("host-bound decode loop (batch 1): emulated CC with the shim vs plain tokens/s",
             hb_vs_plain["emulated+shim"], HOST_BOUND_GOAL, "x", True),
        Goal("per-step token readback host cost: emulated CC with the shim vs plain",
             readback_us["emulated+shim"] / readback_us["plain"], READBACK_GOAL, "x", False),
        Goal("host-bound decode loop (batch 1): emulated CC with the shim and its D2H helper vs plain tokens/s",
             hb_vs_plain[HELPER_SETUP], HOST_BOUND_GOAL, "x", True),
        Goal("per-step token readback host cost: emulated CC with the shim and its D2H helper vs plain",
             readback_us[HELPER_SETUP] / readback_us["plain"], READBACK_GOAL, "x", False),
        Goal("emulated CC with the shim vs plain no-CC, tokens/s", median["emulated+shim"] / plain, 0.95, "x", True),
        Goal("shim installed without CC vs plain, tokens/s", median["shim"] / plain, 0.98, "x", True),
        Goal("decode loop recording 2 events/step, emulated CC with the shim vs the same loop plain, tokens/s",
             median["emulated+shim" + EVENTS] / median["plain" + EVENTS], 0.95, "x", True),
        Goal("1 MiB H2D behind 20 ms: host return with shim / without (emulated CC)",
             h2d_us["emulated+shim"] / h2d_us["emulated"], 0.02, "x", False),
        Goal("1 MiB H2D behind 20 ms: host return, emulated CC with the shim / no CC (same run)",
             h2d_us["emulated+shim"] / h2d_us["plain"], H2D_GOAL_VS_PLAIN, "x", False),
        Goal("1 MiB H2D on an idle GPU: host return, emulated CC with the shim / the transfer alone (same run)",
             h2d_us[SHIM_IDLE] / h2d_us[TRANSFER_ALONE], H2D_GOAL_VS_TRANSFER, "x", False),
    ]

    def plot(path):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.bar(list(LOOP_SETUPS), [median[s] for s in LOOP_SETUPS],
                 color=["#555", "#888", "#c44", "#4a4", "#777", "#6b6"])
        left.set_ylabel("tokens/s (median)")
        left.set_title(f"decode loop, batch {BATCH}, ~{target_ms:g} ms/step")
        left.tick_params(axis="x", labelrotation=15)
        names = list(h2d_us)
        right.bar([n.split(" (")[0] for n in names], [h2d_us[n] for n in names],
                  color=["#555", "#888", "#c44", "#4a4", "#aaa", "#8c8"])
        right.set_yscale("log")
        right.set_ylabel("host time to return (us, log)")
        right.set_title("1 MiB non_blocking H2D (behind 20 ms of GPU work unless marked)")
        right.tick_params(axis="x", labelrotation=15)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return BenchOutput(
        name="cc",
        title="Confidential Computing copies (emulated CC)",
        data={"tokens_per_s": tokens_per_s, "median_tokens_per_s": median, "h2d_return_us": h2d_us,
              "host_bound_tokens_per_s": host_bound, "host_bound_graph_us": graph_us,
              "host_bound_vs_plain": hb_vs_plain, "host_bound_vs_floor": hb_vs_floor,
              "host_bound_late_sync_us": late_sync_us[HOST_BOUND_LOOP],
              "host_bound_wait_stream_us": wait_stream_us[HOST_BOUND_LOOP],
              "gpu_paced_wait_stream_us": wait_stream_us[GPU_PACED_LOOP],
              "gpu_paced_tokens_per_s": loop_rates[GPU_PACED_LOOP], "gpu_paced_vs_plain": vs_plain[GPU_PACED_LOOP],
              "gpu_paced_vs_floor": vs_floor[GPU_PACED_LOOP], "gpu_paced_late_sync_us": late_sync_us[GPU_PACED_LOOP],
              "gpu_paced_eager_launches": _cc_hostbound.GPU_PACED_LAUNCHES,
              "host_bound_eager_launches": _cc_hostbound.EAGER_LAUNCHES, "readback_step_us": readback_us,
              "event_record_us": record_us,
              "gpu_ms_per_step": target_ms, "spin_cycles_per_ms": cycles, "batch": BATCH, "hidden": HIDDEN,
              "steps": steps, "rounds": rounds,
              "host_bound_rounds": host_bound_rounds, "stats": stats},
        tables=[
            (f"Host-bound decode loop: batch 1, a CUDA graph of {graph_us:.0f} us of GPU time and "
             f"{_cc_hostbound.EAGER_LAUNCHES} eager launches per step",
             LOOP_COLUMNS, loop_rows[HOST_BOUND_LOOP]),
            (f"GPU-paced decode loop: the same graph and {_cc_hostbound.GPU_PACED_LAUNCHES} eager launches per step "
             "(the host has time to spare)", LOOP_COLUMNS, loop_rows[GPU_PACED_LOOP]),
            ("One step's token readback (8 int64 on a D2H stream, an event, read one step late): median host time",
             ["setup", "us per step", "vs plain", "vs the transfer floor"], readback_rows),
            ("Decode loop throughput", ["setup", "tokens/s (median)", "vs plain", "min", "max"], rows),
            ("1 MiB non_blocking H2D behind 20 ms of queued GPU work, and on an idle GPU where marked "
             "(median host time)",
             ["setup", "us to return", "vs plain (no CC)", "vs emulated", "vs the transfer alone"], h2d_rows),
            ("torch.cuda.Event.record() on the current stream (median host time)", ["setup", "us", "vs plain"],
             record_rows),
        ],
        goals=goals,
        plot=plot,
        notes=[
            "The reference GPUs have CC off; 'emulated' makes every non_blocking host<->device copy wait for its "
            "stream, as the driver does under CC (syncless.cc.emulate).",
            "Tokens are read back on a stream from syncless.cc.new_d2h_stream(); the host consumes them one step late.",
            f"Host-bound rows: {HOST_BOUND_ROUNDS} short rounds; 'vs plain' and 'vs the transfer floor' are medians of "
            "per-round ratios (each round runs every setup once, in an order rotated from round to round, so a drift "
            "of the host's speed between rounds cancels and no setup always runs first); 'transfer floor' is plain "
            "torch plus a cuStreamSynchronize of the D2H stream after each readback, the wait CC makes a copy made "
            "at the call: the most a shim that reads back at the call can reach. 'host waits at the late sync' is the "
            "median host time per step in the one-step-late Event.synchronize(): near 0 where the host sets the "
            "loop's pace; where the GPU does, the host's time to spare, and a shim that offloads the readback "
            "(which the shim does when timing the loop both ways says it is faster) can beat the floor. With the "
            "readback offloaded the shim's wait moves to 'host in d2h.wait_stream': its patch of wait_stream runs "
            "the previous step's copy first (the event it records covers that copy), an enqueue for torch. The "
            f"GPU-paced loop is the same loop with {_cc_hostbound.GPU_PACED_LAUNCHES} eager launches a step instead "
            f"of {_cc_hostbound.EAGER_LAUNCHES}, so that the GPU sets the pace on any host, as in a compiled decode "
            "loop whose step is its GPU time; each round runs both loops per setup.",
            "'+events' rows: the same loop also records a torch.cuda.Event and a torch.Event on the current stream "
            "each step after the readback and synchronizes the previous step's; with the shim each of them covers "
            "the offloaded copies issued before it (the any-event rule).",
            f"Each step: embedding of the uploaded ids and positions, {target_ms:g} ms of GPU work (one calibrated "
            "spin kernel standing for a CUDA-graphed forward pass), a 4096 x 32000 sampling head and argmax.",
            "The transfer alone: torch's copy and a stream synchronize on an idle GPU, no syncless code, so the host "
            "waits for the 1 MiB copy itself and nothing else (what CC's driver makes it wait for). Under CC the copy "
            "call returns only after its transfer; a design that issues it on the "
            "calling thread cannot return sooner, so that row, not plain, bounds what the shim can reach; the "
            "shim's own cost is the idle-GPU row with the shim against it.",
            f"H2D rows: {H2D_ROUNDS} rounds, each timing every row in turn; medians over all rounds. Every ratio "
            "column divides by its row's reference as measured (plain and emulated: behind 20 ms of work), the "
            "idle-GPU rows included.",
        ],
    )

"""Where the host-bound decode loop's time goes, per phase of a step, per setup (a probe, not a test).

Run on a GPU from the source tree::

    PYTHONPATH=src python3 tests/gpu/cc/probe_hostbound.py [--steps 400] [--rounds 3] [--profile]

Runs :func:`syncless.bench._cc_hostbound.decode_loop`'s loop with a timer around each phase (the H2D of the
position, its device copy, the graph replay, the eager launches, ``d2h.wait_stream``, the readback's ``.to``, the
event, the one-step-late synchronize and ``int``) in the setups ``--setups`` names, rounds interleaved, and prints
each phase's median host microseconds per step and the step's. Setups: ``plain``; ``floor`` (plain torch and a
``cuStreamSynchronize`` of the D2H stream after the readback: the transfer CC makes the calling thread wait for,
and nothing else); ``emulated``; ``emulated+shim``; and the shim with one thing changed: ``+copy_`` (the upload as
``step.pos.copy_(h, non_blocking=True)``), ``+inplace`` (into a registered target), ``+noinline`` (the upload
staged), ``+helper`` (the D2H helper process), ``+offload`` (every readback offloaded, its job run by the thread
that waits for it), ``+look`` (every small readback takes the look, as before
run 64: no timing of both ways), ``+eager`` (offloaded and run by the queue's own thread at once), ``+readnow`` (every small
readback torch's own, whatever is queued), ``+nowords`` (the 8-byte upload by the inline kernel, not a stream
memory op), ``+nolook`` (read back now only from a stream found drained at once).
For the shim it also counts, per thread, how many jobs each ran and how often the queue's thread woke.
``+nogc`` after any setup runs its loop with Python's cyclic garbage collector off (``gc.disable()``). Each
round's line gives the step's median and mean (the mean is what tokens/s sees), its 99th percentile and maximum, and
the collections Python's collector made during the loop with their total time.
``--profile`` adds a cProfile of the shim's loop (top functions by own time; ``--profile-setup`` names another).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import pstats
import statistics
import threading
import time

PHASES = ("h2d", "d2d", "replay", "launches", "wait_stream", "to_cpu", "event", "sync_prev", "int")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--launches", type=int, default=None,
                        help="eager launches per step (default: the bench's host-bound loop's; 8: its GPU-paced loop)")
    parser.add_argument("--profile-setup", default="emulated+shim", help="the setup --profile profiles")
    parser.add_argument("--calls", action="store_true",
                        help="per line of the loop and per setup: the Python calls (syncless's own, the rest) and C "
                             "calls one step makes, and the syncless functions they enter (sys.setprofile)")
    parser.add_argument("--untimed", action="store_true",
                        help="the bench's own loop (no timer per phase): tokens/s per setup, paired with plain's in "
                             "each round, and what the shim did with the readbacks")
    parser.add_argument("--setups", default="plain,emulated,emulated+shim,emulated+shim+helper,emulated+shim+copy_",
                        help="comma-separated; also: floor, emulated+shim+nowords, emulated+shim+offload, emulated+shim+eager, "
                             "emulated+shim+readnow, emulated+shim+nolook, emulated+shim+noinline, "
                             "emulated+shim+inplace, emulated+shim+look")
    args = parser.parse_args()

    import torch

    import syncless.cc as cc
    from syncless.bench import _cc_hostbound
    from syncless.cc import _worker

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    step = _cc_hostbound.build_step(torch, dev)
    launches = _cc_hostbound.EAGER_LAUNCHES if args.launches is None else args.launches
    print(f"graph: {step.gpu_us():.0f} us of GPU time, {launches} eager launches per step")
    d2h = cc.new_d2h_stream(dev)
    ran_by: collections.Counter = collections.Counter()
    woke: collections.Counter = collections.Counter()
    run_head = _worker.OrderedWorker._run_head

    def counting_run_head(self):
        ran_by[threading.current_thread().name] += 1
        return run_head(self)

    _worker.OrderedWorker._run_head = counting_run_head
    original_loop = _worker.OrderedWorker._loop

    def counting_loop(self):
        cv_wait = self._cv.wait

        def wait(timeout=None):
            result = cv_wait(timeout)
            woke[threading.current_thread().name] += 1
            return result

        self._cv.wait = wait
        return original_loop(self)

    _worker.OrderedWorker._loop = counting_loop

    from syncless._core import libcuda
    from syncless.cc import _d2h, _d2h_job, _fast, _shim

    from syncless.cc import _inline_h2d

    defaults = (_fast.READ_BACK_NOW_BYTES, _d2h_job.EAGER_BYTES, _fast.DRAIN_LOOK_S)
    _inline_h2d.functions(0)  # loads the inline kernel, and says whether this GPU takes word writes
    words = _inline_h2d._WORD_WRITES.get(0, False)
    lane = _fast._lane()
    stream_query = lane.stream_query

    from syncless.cc import _readback_choice

    d2h_record = _d2h.lookup(d2h)
    choices: dict = {}  # setup -> its D2H stream's choice of way, kept from round to round as a loop keeps it

    def enter(setup: str) -> None:
        setup = setup.removesuffix("+nogc")
        cc.uninstall()
        if setup not in choices:
            choices[setup] = _readback_choice.ReadbackChoice()
            if setup.endswith("+look"):
                choices[setup].pin(_readback_choice.LOOK)  # the look for every readback (before run 64)
            elif setup.endswith("+offload"):
                choices[setup].pin(_readback_choice.OFFLOAD)
        d2h_record.choice = choices[setup]
        _fast.READ_BACK_NOW_BYTES, _d2h_job.EAGER_BYTES, _fast.DRAIN_LOOK_S = defaults
        if setup.endswith("+nolook"):
            _fast.DRAIN_LOOK_S = 0.0  # read back now only from a stream found drained at once (run 49's rule)
        lane.stream_query = stream_query
        _inline_h2d._WORD_WRITES[0] = words and not setup.endswith("+nowords")  # +nowords: the 8-byte upload a kernel
        if setup.endswith("+offload") or setup.endswith("+eager"):
            _fast.READ_BACK_NOW_BYTES = 0  # every readback offloaded
        if setup.endswith("+eager"):
            _d2h_job.EAGER_BYTES = 0  # and run by the queue's own thread at once
        if setup.endswith("+readnow"):
            lane.stream_query = lambda stream: True  # every small readback torch's own, then the emulated wait
        if setup == "emulated":
            cc.emulate()
        elif setup.endswith("+helper"):
            from syncless.bench import _cc as bench_cc

            bench_cc._install_with_helper(cc)
        elif setup.startswith("emulated+shim"):
            cc.install("emulate")
            if setup.endswith("+noinline"):
                _shim._STATE.inline_max_bytes = 0  # the upload staged, as before the inline kernel

    def untimed(setups) -> None:
        from syncless.bench import _cc as bench_cc

        rates = {s: [] for s in setups}
        for round_index in range(args.rounds):
            for setup in bench_cc.rotated(tuple(setups), round_index):  # the order rotated, as the bench's rounds
                enter(setup)
                cc.reset_stats()
                if setup.endswith("+nogc"):
                    gc.disable()
                try:
                    rates[setup].append(_cc_hostbound.decode_loop(torch, dev, step, d2h, args.steps, 50,
                                                                  floor=setup.removesuffix("+nogc") == "floor",
                                                                  launches=launches))
                finally:
                    gc.enable()
                did = cc.stats()
                way = d2h_record.choice
                print(f"round {round_index + 1} {setup:24s} {rates[setup][-1]:7.0f} tokens/s  offloaded "
                      f"{did.offloaded}, read back now {did.left_alone.get('idle_stream', 0)}, inlined {did.inlined}"
                      f"  way {'offload' if way.way else 'look'} (trials {way.trials}, switches {way.switches}"
                      f"{bench_cc._last_trial(way)})")
        print()
        for setup in setups:
            ratios = [r / p for r, p in zip(rates[setup], rates["plain"])]
            print(f"{setup:24s} median {statistics.median(rates[setup]):7.0f} tokens/s, vs plain (paired median) "
                  f"{statistics.median(ratios):.3f}x, per round {' '.join(f'{x:.3f}' for x in ratios)}")

    def loop(setup: str, steps: int, warmup: int = 50):
        nogc = setup.endswith("+nogc")
        setup = setup.removesuffix("+nogc")
        current = torch.cuda.current_stream(dev)
        inplace = setup.endswith("+inplace") or setup.endswith("+copy_")
        floor = setup == "floor"
        blocking = libcuda.libraries()[1]
        if inplace:
            cc.register_inplace_h2d_target(step.pos)
        ring = [torch.zeros(1, dtype=torch.int64, pin_memory=True) for _ in range(4)]
        spent = {p: [] for p in PHASES}
        totals = []
        pending = None
        clock = time.perf_counter
        collected = [0, 0.0, 0.0]  # collections during the measured steps, their seconds, the start of the current one

        def on_gc(phase, info):
            if phase == "start":
                collected[2] = clock()
            else:
                collected[0] += 1
                collected[1] += clock() - collected[2]

        if nogc:
            gc.disable()
        for index in range(warmup + steps):
            if index == warmup:
                gc.callbacks.append(on_gc)
            t = [clock()]
            pos_host = ring[index % 4]
            pos_host[0] = index
            if inplace:
                step.pos.copy_(pos_host, non_blocking=True)
                t.append(clock())
                t.append(clock())
            else:
                pos = pos_host.to(dev, non_blocking=True)
                t.append(clock())
                step.pos.copy_(pos)
                t.append(clock())
            step.graph.replay()
            t.append(clock())
            for _ in range(launches):
                step.scratch.add_(1.0)
            t.append(clock())
            d2h.wait_stream(current)
            t.append(clock())
            with torch.cuda.stream(d2h):
                token_host = step.token.to("cpu", non_blocking=True)
                if floor:  # CC's transfer wait, paid by this thread, and nothing else
                    code = blocking.cuStreamSynchronize(d2h.cuda_stream)
                    assert code == 0, code
                t.append(clock())
                ready = torch.cuda.Event()
                ready.record(d2h)
            t.append(clock())
            if pending is not None:
                pending[1].synchronize()
                t.append(clock())
                int(pending[0][0])
                t.append(clock())
            else:
                t += [clock(), clock()]
            pending = (token_host, ready)
            if index >= warmup:
                for name, a, b in zip(PHASES, t, t[1:]):
                    spent[name].append((b - a) * 1e6)
                totals.append((t[-1] - t[0]) * 1e6)
        pending[1].synchronize()
        torch.cuda.synchronize(dev)
        gc.callbacks.remove(on_gc)
        if nogc:
            gc.enable()
        loop.last = totals, collected[0], collected[1]
        return {p: statistics.median(v) for p, v in spent.items()}, statistics.median(totals)

    def calls_per_line(setup: str, steps: int = 20) -> None:
        """One step's calls, per line of :func:`loop` (counted over ``steps`` steps after a warm-up)."""
        import linecache
        import sys

        enter(setup)
        loop(setup, 30, warmup=20)
        code = loop.__code__
        per_line: dict = collections.defaultdict(lambda: [0, 0, 0, collections.Counter()])

        def line_of(frame):
            while frame is not None and frame.f_code is not code:
                frame = frame.f_back
            return frame.f_lineno if frame is not None else None

        def profile(frame, event, arg):
            if event not in ("call", "c_call"):
                return
            line = line_of(frame if event == "c_call" else frame.f_back)
            if line is None:
                return
            row = per_line[line]
            if event == "c_call":
                row[2] += 1
            elif "/syncless/" in frame.f_code.co_filename:
                row[0] += 1
                row[3][f"{frame.f_code.co_filename.rsplit('/', 1)[-1][:-3]}:{frame.f_code.co_name}"] += 1
            else:
                row[1] += 1

        sys.setprofile(profile)
        try:
            loop(setup, steps, warmup=0)
        finally:
            sys.setprofile(None)
        print(f"== calls per step, {setup} (syncless Python, other Python, C; per line of the loop)")
        total = [0.0, 0.0, 0.0]
        for line in sorted(per_line):
            ours, other, c_calls, names = per_line[line]
            if not (ours or other or c_calls):
                continue
            text = linecache.getline(code.co_filename, line).strip()[:60]
            print(f"  {ours / steps:5.1f} {other / steps:5.1f} {c_calls / steps:6.1f}  {text}")
            if ours:
                print("        " + " ".join(f"{name}x{count / steps:g}" for name, count in names.most_common()))
            for i, value in enumerate((ours, other, c_calls)):
                total[i] += value / steps
        print(f"  {total[0]:5.1f} {total[1]:5.1f} {total[2]:6.1f}  per step in all")

    setups = tuple(args.setups.split(","))
    if args.calls:
        for setup in setups:
            calls_per_line(setup)
        cc.uninstall()
        return
    if args.untimed:
        untimed(setups)
        cc.uninstall()
        return
    results = {s: [] for s in setups}
    for round_index in range(args.rounds):
        for setup in setups:
            enter(setup)
            ran_by.clear()
            woke.clear()
            phases, total = loop(setup, args.steps)
            results[setup].append((phases, total))
            extra = ""
            if "shim" in setup:
                extra = (f"  jobs run by {dict(ran_by)}, queue thread woke {dict(woke)}, way "
                         f"{'offload' if d2h_record.choice.way else 'look'}")
            totals, collections_made, gc_s = loop.last
            ordered = sorted(totals)
            tail = (f" mean {statistics.fmean(totals):6.1f} p99 {ordered[int(0.99 * (len(ordered) - 1))]:6.1f} "
                    f"max {ordered[-1]:7.1f}; gc {collections_made} x, {gc_s * 1e6:.0f} us")
            print(f"round {round_index + 1} {setup:24s} step {total:7.1f} us ({1e6 / total:6.0f} tokens/s){tail}{extra}")
    print()
    print(f"{'phase (median us)':18s}" + "".join(f"{s:>24s}" for s in setups))
    for name in PHASES + ("step",):
        row = []
        for setup in setups:
            values = [(r[1] if name == "step" else r[0][name]) for r in results[setup]]
            row.append(statistics.median(values))
        print(f"{name:18s}" + "".join(f"{v:24.1f}" for v in row))
    if args.profile:
        enter(args.profile_setup)
        profiler = cProfile.Profile()
        profiler.enable()
        loop(args.profile_setup, 200, warmup=10)
        profiler.disable()
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).sort_stats("tottime").print_stats(45)
        print(buffer.getvalue())
    cc.uninstall()


if __name__ == "__main__":
    main()

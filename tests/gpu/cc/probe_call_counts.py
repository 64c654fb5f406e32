"""How many Python and C calls, and how much host time, each of the shim's hot paths costs (not a test).

Run on a GPU from the source tree (``--src`` picks which syncless to import, so one machine can compare two
versions of the code in one run)::

    python3 tests/gpu/cc/probe_call_counts.py [--src src] [--repeats 400] [--label new]

Under ``cc.install("emulate")`` on one GPU, with a small kernel queued first, it counts with
``sys.setprofile`` (Python calls, split into syncless's own and the rest, and C calls) and times (median host
microseconds of ``--repeats``) each of:

- ``d2h``: ``tokens.to("cpu", non_blocking=True)`` of 8 int64 on a ``cc.new_d2h_stream()`` (the offload);
- ``record``: ``ready.record(d2h)`` right after it;
- ``consume``: the next step's ``ready.synchronize()`` of the previous step's event (the covering wait, which
  now runs the copy itself);
- ``h2d-8B`` / ``h2d-1MiB``: ``ids.to("cuda", non_blocking=True)`` of 8 bytes and of 1 MiB of pinned memory
  (staged), on an idle GPU.

Also the same readback step with the D2H helper process (``helper``: ``SYNCLESS_CC_D2H_HELPER=1``), under plain
torch (no CC, no shim) and the transfer alone for the 1 MiB H2D
(torch's copy and a stream synchronize), for the ratios the issue asks for. Prints one table; ``--json``
writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


CALLED: dict[str, list[str]] = {}  # path -> the syncless functions its counted call entered, in order (--names)


def _count(fn, label: str = ""):
    """Run ``fn()`` once under a profiler; return (syncless Python calls, other Python calls, C calls). With a
    ``label``, the names of the syncless functions entered go into :data:`CALLED` under it."""
    counts = [0, 0, 0]
    names = CALLED.setdefault(label, []) if label else None

    def prof(frame, event, arg):
        if event == "call":
            ours = "syncless" in frame.f_code.co_filename
            counts[0 if ours else 1] += 1
            if ours and names is not None:
                names.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
        elif event == "c_call":
            counts[2] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return tuple(counts)


def _profile_steps(torch, d2h, tokens, current, steps: int, setup: str) -> None:
    """``steps`` readback steps (the d2h, the record, the next step's synchronize) under cProfile; print the top
    functions by own time, per step."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    previous = None
    for _ in range(steps):
        tokens.add_(1)
        d2h.wait_stream(current)
        profiler.enable()
        with torch.cuda.stream(d2h):
            host = tokens.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(d2h)
        if previous is not None:
            previous[1].synchronize()
        profiler.disable()
        previous = (host, ready)
    previous[1].synchronize()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:25]
    print(f"== cProfile, {setup}, {steps} readback steps: own time and calls per step (us), top 25")
    for (filename, line, name), (calls, _, own, cumulative, _) in rows:
        where = f"{filename.rsplit('/', 1)[-1]}:{line}:{name}"
        print(f"  {own / steps * 1e6:8.2f} own {cumulative / steps * 1e6:8.2f} cum {calls / steps:6.2f} calls  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default="src", help="the source tree whose syncless to import (default: src)")
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--label", default="")
    parser.add_argument("--json", default="")
    parser.add_argument("--names", action="store_true",
                        help="also list the syncless functions each counted call entered")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also run STEPS readback steps per setup under cProfile and print where the host time "
                             "goes (the top functions by own time; cProfile slows every call alike)")
    args = parser.parse_args()
    sys.path.insert(0, args.src)

    import torch

    import syncless
    import syncless.cc as cc

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rows = {}

    def readback_loop(setup: str) -> None:
        cc.uninstall()
        if setup == "shim":
            cc.install("emulate")
        elif setup == "helper":  # the shim with SYNCLESS_CC_D2H_HELPER=1, GPU 0's helper process ready
            from syncless.bench import _cc as bench_cc

            bench_cc._install_with_helper(cc)
        d2h = cc.new_d2h_stream(dev) if setup != "plain" else torch.cuda.Stream(dev)
        tokens = torch.zeros(8, dtype=torch.int64, device=dev)
        current = torch.cuda.current_stream(dev)
        times = {"d2h": [], "record": [], "consume": []}
        counts = {}
        previous = None
        for step in range(args.repeats + 20):
            tokens.add_(1)
            d2h.wait_stream(current)
            with torch.cuda.stream(d2h):
                t0 = time.perf_counter()
                host = tokens.to("cpu", non_blocking=True)
                t1 = time.perf_counter()
                ready = torch.cuda.Event()
                t2 = time.perf_counter()
                ready.record(d2h)
                t3 = time.perf_counter()
            if previous is not None:
                t4 = time.perf_counter()
                previous[1].synchronize()
                t5 = time.perf_counter()
                assert int(previous[0][0]) == step  # the token of the previous step
                if step >= 20:
                    times["consume"].append((t5 - t4) * 1e6)
            if step >= 20:
                times["d2h"].append((t1 - t0) * 1e6)
                times["record"].append((t3 - t2) * 1e6)
            previous = (host, ready)
        if args.profile:
            _profile_steps(torch, d2h, tokens, current, args.profile, setup)
        # One more step, counted.
        tokens.add_(1)
        d2h.wait_stream(current)
        with torch.cuda.stream(d2h):
            box = {}
            counts["d2h"] = _count(lambda: box.__setitem__("h", tokens.to("cpu", non_blocking=True)), f"{setup}:d2h")
            ready = torch.cuda.Event()
            counts["record"] = _count(lambda: ready.record(d2h))
        time.sleep(0.01)  # the copy's source is ready: the consume below is the common case
        counts["consume"] = _count(lambda: ready.synchronize())
        torch.cuda.synchronize()
        if setup != "plain":
            cc.close_d2h_stream(d2h)
        for name in times:
            rows[f"{setup}:{name}"] = (statistics.median(times[name]), counts[name])

    def h2d(setup: str, nbytes: int, then_wait: bool = False) -> None:
        cc.uninstall()
        if setup == "shim":
            cc.install("emulate")
        host = torch.zeros(nbytes // 8, dtype=torch.int64).pin_memory()
        stream = torch.cuda.current_stream(dev)
        samples = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = host.to(dev, non_blocking=True)
            if then_wait:
                stream.synchronize()
            samples.append((time.perf_counter() - t0) * 1e6)
            del out
        torch.cuda.synchronize()
        box = {}
        name = f"{setup}:h2d-{'1MiB' if nbytes >= 1 << 20 else f'{nbytes}B'}" + (":transfer-alone" if then_wait else "")
        count = _count(lambda: box.__setitem__("o", host.to(dev, non_blocking=True)), name)
        torch.cuda.synchronize()
        rows[name] = (statistics.median(samples), count)

    for setup in ("plain", "shim", "helper"):
        readback_loop(setup)
    for setup in ("plain", "shim"):
        h2d(setup, 8)
        h2d(setup, 1 << 20)
    h2d("plain", 1 << 20, then_wait=True)
    cc.uninstall()

    label = args.label or syncless.__file__
    print(f"== call counts and host time, {label} (syncless from {syncless.__file__})")
    print(f"{'path':40s} {'host us (median)':>17s} {'syncless py':>12s} {'other py':>9s} {'C calls':>8s}")
    for name, (us, (ours, other, c_calls)) in rows.items():
        print(f"{name:40s} {us:17.1f} {ours:12d} {other:9d} {c_calls:8d}")
    step_plain = sum(rows[f"plain:{n}"][0] for n in ("d2h", "record", "consume"))
    step_shim = sum(rows[f"shim:{n}"][0] for n in ("d2h", "record", "consume"))
    print(f"per-step readback host cost: plain {step_plain:.1f} us, emulated+shim {step_shim:.1f} us "
          f"({step_shim / step_plain:.2f}x)")
    idle = rows["shim:h2d-1MiB"][0] / rows["plain:h2d-1MiB:transfer-alone"][0]
    print(f"1 MiB idle H2D, shim vs the transfer alone: {idle:.2f}x")
    if args.names:
        for path, names in CALLED.items():
            if names:
                print(f"{path}: {len(names)} syncless calls: {' '.join(names)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"label": label, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()

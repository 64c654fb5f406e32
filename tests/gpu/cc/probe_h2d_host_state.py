"""Is a 1 MiB H2D slower behind queued GPU work because the GPU is busy, or because the host just waited? (a probe)

Run on a GPU from the source tree::

    PYTHONPATH=src python3 tests/gpu/cc/probe_h2d_host_state.py [--repeats 41]

``syncless bench cc`` times the copy right after ``torch.cuda.synchronize()``
returned and 20 ms of work were queued. Host code then runs several times
slower than on a host that has been busy (``probe_h2d_breakdown.py
--queued-ms 20``: pure-Python steps 4-5x), which weighs most on a path with
Python in it. This probe times the same copies (plain torch without CC, the
shim under emulated CC, and emulated CC alone on an idle GPU: the transfer)
and one pure-Python step of the shim (reading a call, no CUDA) in five host
states:

    after sync, queued   synchronize, queue 20 ms, time at once (the bench's state)
    after sync, idle     synchronize, time at once (GPU idle)
    host slept, queued   queue 40 ms, time.sleep 20 ms (the OS idles the core), time
    host busy, queued    queue 40 ms, 20 ms of Python work, time (an engine's loop: the
                         host prepares the next step while the GPU runs this one)
    host busy, idle      20 ms of Python work on an idle GPU, time

Medians of ``--repeats`` samples, in microseconds.
"""

from __future__ import annotations

import argparse
import time

from probe_timing import median_host_us  # beside this script


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    total = 0
    while time.perf_counter() < end:
        total += sum(range(64))  # Python work, as an engine's scheduler does between steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()

    import torch

    import syncless.cc as cc
    from syncless.bench._cc import _cycles_per_ms
    from syncless.cc._layers import call_for_routing

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cc.uninstall()
    cycles_per_ms = _cycles_per_ms(torch)
    host = torch.randn(1 << 18).pin_memory()

    def queue(ms: float) -> None:
        torch.cuda._sleep(int(cycles_per_ms * ms))

    states = {
        "after sync, queued": lambda: queue(20),
        "after sync, idle": lambda: None,
        "host slept, queued": lambda: (queue(40), time.sleep(0.02)),
        "host busy, queued": lambda: (queue(40), _busy(0.02)),
        "host busy, idle": lambda: _busy(0.02),
    }
    call = ((host, dev), {"non_blocking": True})

    def read_call():
        for _ in range(10):
            call_for_routing(*call)

    workloads = {
        "plain .to, no CC": ("none", lambda: host.to(dev, non_blocking=True)),
        "shim, emulated CC": ("emulate", lambda: host.to(dev, non_blocking=True)),
        "emulated CC, no shim": ("emulate-only", lambda: host.to(dev, non_blocking=True)),
        "10 x call_for_routing (Python)": ("none", read_call),
    }

    table = {}
    try:
        for name, (setup, fn) in workloads.items():
            cc.uninstall()
            if setup == "emulate":
                cc.install("emulate")
            elif setup == "emulate-only":
                cc.emulate()
            fn()
            torch.cuda.synchronize(dev)
            for state, setup_state in states.items():
                if setup == "emulate-only" and state.endswith("queued"):
                    continue  # emulated CC alone waits for the queued work: 20 ms, nothing to learn
                table[(name, state)] = median_host_us(torch, dev, fn, args.repeats, before=setup_state)
    finally:
        cc.uninstall()
    print(f"median us of {args.repeats}; 1 MiB pinned non_blocking H2D (host time to return)")
    print(f"{'':32s}" + "".join(f"{state:>21s}" for state in states))
    for name in workloads:
        cells = [table.get((name, state)) for state in states]
        print(f"{name:32s}" + "".join(f"{'-' if c is None else f'{c:.1f}':>21s}" for c in cells))
    for state in states:
        plain = table[("plain .to, no CC", state)]
        ours = table[("shim, emulated CC", state)]
        print(f"shim under emulated CC / plain, {state}: {ours / plain:.2f}x")


if __name__ == "__main__":
    main()

"""Why is the shim's 1 MiB H2D slower inside ``syncless bench cc`` than in ``probe_h2d_cost.py``? (a probe, not a test)

Run on a GPU from the source tree::

    PYTHONPATH=src python3 tests/gpu/cc/probe_h2d_bench_state.py

It times the bench's own H2D measurement (``_h2d_return_us``) for each setup
three times: in a fresh process, after the bench's decode loops have run (the
state the bench measures in), and with a warm-up call first. Then it profiles
the shim's path under emulated CC in the bench's state (cProfile, top entries
by own time), so the table says where the host time goes.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time


def main() -> None:
    import torch

    import syncless.cc as cc
    from syncless.bench import _cc as bench

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cc.uninstall()
    cycles = bench._cycles_per_ms(torch)

    def measure(label: str, warm: bool = False) -> None:
        row = []
        for setup in bench.SETUPS:
            bench._enter(setup)
            if warm:
                bench._h2d_return_us(torch, dev, cycles, 1)
            row.append(f"{setup} {statistics.median(bench._h2d_return_us(torch, dev, cycles, 21)):8.1f}")
        cc.uninstall()
        print(f"{label:28s} " + " | ".join(row), flush=True)

    print("median us to return, 1 MiB pinned non_blocking H2D behind 20 ms (the bench's own function)")
    measure("fresh process")
    model = bench._Model(torch, dev, int(cycles * 3.0))
    d2h = cc.new_d2h_stream(dev)
    for setup in bench.SETUPS:
        bench._enter(setup)
        bench._decode_loop(torch, dev, model, d2h, 40, 10)
    cc.uninstall()
    measure("after the decode loops")
    measure("again, warm-up call first", warm=True)

    host = torch.randn(1 << 18).pin_memory()
    for setup in ("plain", "emulated+shim"):
        bench._enter(setup)
        profile = cProfile.Profile()
        spent = []
        for _ in range(21):
            torch.cuda.synchronize(dev)
            torch.cuda._sleep(cycles * 20)
            t0 = time.perf_counter()
            profile.enable()
            out = host.to(dev, non_blocking=True)
            profile.disable()
            spent.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize(dev)
            del out
        cc.uninstall()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(f"\n== cProfile, {setup}: median {statistics.median(spent):.1f} us per call under the profiler")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()

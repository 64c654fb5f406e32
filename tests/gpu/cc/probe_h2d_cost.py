"""Where does the shim's 1 MiB H2D spend its host time? A breakdown, printed as a table (not a test).

Run on a GPU from the source tree::

    PYTHONPATH=src python3 tests/gpu/cc/probe_h2d_cost.py [--repeats 21] [--queued-ms 20]

Each row times, on the host, one way of issuing a 1 MiB ``non_blocking``
H2D of pinned memory (median of ``--repeats``), with ``--queued-ms`` of GPU
work queued on the current stream first (as ``syncless bench cc`` does) and
with the GPU idle. The rows build the shim's path up piece by piece, so the
differences between them are the pieces' costs:

    plain .to                      torch alone (the target: the shim may cost 1.5x this)
    .to on the staging stream      + switching to the staging stream, allocating from its pool
    + stream sync (emulated CC)    + the host waiting for the transfer, as CC makes it (inherent)
      (or: + polling)              the same wait by spinning on cuStreamQuery (is the driver's wake-up slow?)
    + order current after staging  + event record and stream wait
    + record_stream                + the allocator's bookkeeping
    shim, emulated CC              syncless.cc.install("emulate"), the real path
    shim, no CC                    syncless.cc.install("on")
    emulated CC, no shim           syncless.cc.emulate() (waits for the queued work)

and a second table times single calls the path makes (microseconds per call,
mean of 200), with the same queued work.
"""

from __future__ import annotations

import argparse
import time

from probe_timing import median_host_us  # beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="samples per row (default: 21)")
    parser.add_argument("--queued-ms", type=float, default=20.0, help="GPU work queued before each copy (default: 20)")
    args = parser.parse_args()

    import torch

    import syncless.cc as cc
    from syncless._core import cuda as _cuda
    from syncless._core.tensor_calls import parse_to
    from syncless.bench._cc import _cycles_per_ms
    from syncless.cc import _streams

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cc.uninstall()
    cycles_per_ms = _cycles_per_ms(torch)
    host = torch.randn(1 << 18).pin_memory()  # 1 MiB of float32
    staging = _streams.staging_stream(0)
    current = torch.cuda.current_stream(dev)

    def on_staging():
        with torch.cuda.stream(staging):
            return host.to(dev, non_blocking=True)

    def on_staging_synced():
        with torch.cuda.stream(staging):
            out = host.to(dev, non_blocking=True)
        _streams.wait_stream_raw(staging)
        return out

    drv = _cuda.driver_module()
    not_ready = drv.CUresult.CUDA_ERROR_NOT_READY

    def on_staging_polled():
        with torch.cuda.stream(staging):
            out = host.to(dev, non_blocking=True)
        while True:  # spin: no driver wake-up latency
            result = drv.cuStreamQuery(staging.cuda_stream)
            if (result[0] if isinstance(result, tuple) else result) != not_ready:
                return out

    def ordered():
        out = on_staging_synced()
        _streams.order_after(current, staging)
        return out

    def recorded():
        out = ordered()
        out.record_stream(current)
        return out

    def plain():
        return host.to(dev, non_blocking=True)

    rows = [
        ("plain .to", None, plain),
        (".to on the staging stream", None, on_staging),
        ("+ stream sync (emulated CC)", None, on_staging_synced),
        ("  (or: + polling cuStreamQuery)", None, on_staging_polled),
        ("+ order current after staging", None, ordered),
        ("+ record_stream", None, recorded),
        ("shim, emulated CC", "emulate", plain),
        ("shim, no CC", "on", plain),
        ("emulated CC, no shim", "emulate-only", plain),
    ]

    def queue_work():
        torch.cuda._sleep(int(cycles_per_ms * args.queued_ms))

    def sample(fn, queued: bool) -> float:
        return median_host_us(torch, dev, fn, args.repeats, before=queue_work if queued else None)

    results = []
    try:
        for name, setup, fn in rows:
            cc.uninstall()
            if setup == "emulate":
                cc.install("emulate")
            elif setup == "on":
                cc.install("on")
            elif setup == "emulate-only":
                cc.emulate()
            fn()  # warm-up: first allocation on a stream's pool, lazy loading
            torch.cuda.synchronize(dev)
            results.append((name, sample(fn, True), sample(fn, False)))
    finally:
        cc.uninstall()

    base_queued, base_idle = results[0][1], results[0][2]
    print(f"1 MiB pinned non_blocking H2D, median of {args.repeats}; queued = {args.queued_ms:g} ms of GPU work first")
    print(f"{'path':34s} {'queued us':>10s} {'x plain':>8s} {'idle us':>10s} {'x plain':>8s}")
    for name, queued_us, idle_us in results:
        print(f"{name:34s} {queued_us:10.1f} {queued_us / base_queued:8.2f} {idle_us:10.1f} {idle_us / base_idle:8.2f}")

    def per_call(fn, n=200) -> float:
        torch.cuda.synchronize(dev)
        torch.cuda._sleep(int(cycles_per_ms * args.queued_ms))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t0) * 1e6 / n
        torch.cuda.synchronize(dev)
        return us

    event = torch.cuda.Event()
    base = torch.cuda.Event.__mro__[1]

    def switch_streams():
        with torch.cuda.stream(staging):
            pass

    calls = [
        ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(0)),
        ("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing),
        ("with torch.cuda.stream(staging): pass", switch_streams),
        ("event record (torch, base class)", lambda: base.record(event, current)),
        ("stream wait event (torch, base class)", lambda: base.wait(event, staging)),
        ("cuStreamQuery via cuda-bindings", lambda: _cuda.driver_module().cuStreamQuery(staging.cuda_stream)),
        ("cuStreamSynchronize(idle staging)", lambda: _streams.wait_stream_raw(staging)),
        ("parse_to(args)", lambda: parse_to((dev,), {"non_blocking": True})),
        ("torch.empty 1 MiB on current", lambda: torch.empty(1 << 18, device=dev)),
        ("torch.cuda.Event()", torch.cuda.Event),
    ]
    print(f"\nsingle calls, {args.queued_ms:g} ms of GPU work queued (us per call, mean of 200)")
    for name, fn in calls:
        print(f"{name:44s} {per_call(fn):8.2f}")


if __name__ == "__main__":
    main()

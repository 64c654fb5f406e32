"""Inclusive host time of each step of the shim's 1 MiB H2D, per call (a probe, not a test).

Run on a GPU from the source tree::

    PYTHONPATH=src python3 tests/gpu/cc/probe_h2d_breakdown.py [--calls 200]

Wraps the functions the shim's ``Tensor.to`` path calls in timers, issues
``--calls`` 1 MiB pinned ``non_blocking`` H2D copies (GPU idle, so the
emulated wait is the transfer alone, or behind ``--queued-ms`` of GPU work) and prints, per function, its calls per
copy and its mean inclusive time per copy in microseconds. Nested rows
overlap (a row includes the rows it calls). The timers add ~0.2 us each.
"""

from __future__ import annotations

import argparse
import collections
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--queued-ms", type=float, default=0.0,
                        help="GPU work queued on the current stream before each copy (default: 0, GPU idle)")
    args = parser.parse_args()

    import torch

    import syncless.cc as cc
    from syncless.cc import _emulation, _host_writes, _shim, _staging, _streams

    from syncless.bench._cc import _cycles_per_ms

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    queued_cycles = int(_cycles_per_ms(torch) * args.queued_ms) if args.queued_ms else 0
    state = "GPU idle" if not queued_cycles else f"{args.queued_ms:g} ms queued"
    spent: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.Counter()

    def timed(owner, name, label):
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(owner, name, wrapper)
        return owner, name, inner

    host = torch.randn(1 << 18).pin_memory()
    for mode in ("on", "emulate"):
        cc.uninstall()
        cc.install(mode)
        originals = [
            timed(_shim, "_decide", "shim._decide"),
            timed(_shim, "_present_cuda_index", "shim._present_cuda_index"),
            timed(_shim, "parse_to", "parse_to (shim)"),
            timed(_shim, "call_for_routing", "call_for_routing (shim)"),
            timed(_staging, "land", "staging.land"),
            timed(_host_writes, "order_after_pending_writes", "host_writes.order_after_pending_writes"),
            timed(_streams, "order_after", "streams.order_after"),
            timed(_streams, "any_current_capture", "streams.any_current_capture"),
            timed(_streams, "wait_stream_raw", "streams.wait_stream_raw"),
            timed(_emulation, "_emulate_wait", "emulation._emulate_wait"),
            timed(_emulation, "wait_after_copy_on", "emulation.wait_after_copy_on"),
            timed(_streams, "current_stream", "streams.current_stream"),
            timed(torch.cuda, "current_stream", "torch.cuda.current_stream"),
            timed(torch.cuda, "stream", "torch.cuda.stream (make)"),
            timed(torch.Tensor, "record_stream", "Tensor.record_stream"),
        ]
        for _ in range(20):  # warm-up
            host.to(dev, non_blocking=True)
        torch.cuda.synchronize()
        spent.clear()
        calls.clear()
        total = 0.0
        for _ in range(args.calls):
            if queued_cycles:
                torch.cuda._sleep(queued_cycles)
            t0 = time.perf_counter()
            out = host.to(dev, non_blocking=True)
            total += time.perf_counter() - t0
            torch.cuda.synchronize()
            del out
        for owner, name, inner in reversed(originals):
            setattr(owner, name, inner)
        cc.uninstall()
        print(f"\n== shim {mode!r}: {total / args.calls * 1e6:.1f} us per 1 MiB H2D ({state}, timers on)")
        print(f"{'step':44s} {'calls/copy':>10s} {'us/copy':>8s}")
        for label, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
            print(f"{label:44s} {calls[label] / args.calls:10.2f} {seconds / args.calls * 1e6:8.2f}")
    plain = []
    for _ in range(args.calls):
        if queued_cycles:
            torch.cuda._sleep(queued_cycles)
        t0 = time.perf_counter()
        out = host.to(dev, non_blocking=True)
        plain.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        del out
    print(f"\nplain torch, no shim: {sum(plain) / len(plain) * 1e6:.1f} us per 1 MiB H2D ({state})")


if __name__ == "__main__":
    main()

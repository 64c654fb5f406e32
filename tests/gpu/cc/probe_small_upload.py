"""What a one-element upload costs the host, piece by piece (a probe, not a test): leads for issue 33.

Run on a GPU from the source tree::

    PYTHONPATH=src python3 tests/gpu/cc/probe_small_upload.py [--repeats 2000]

Prints the median host microseconds of: torch's own ``h.to(dev, non_blocking=True)`` (no syncless); the shim's
inline upload (emulated CC); the inline kernel's launch alone; a device allocation; the context check; and two
ways with no copy at all for one element: ``dst.fill_(h.item())`` and ``torch.full`` (the value read on the host,
then one of torch's own kernels). Each sample starts from a drained GPU (``probe_timing``); run 41 timed them back
to back (at ``4971913``).
"""

from __future__ import annotations

import argparse

from probe_timing import median_host_us  # beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()

    import torch

    import syncless.cc as cc
    from syncless.cc import _fast, _inline_h2d, _raw

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    host = torch.tensor([12345], dtype=torch.int64).pin_memory()
    dst = torch.zeros(1, dtype=torch.int64, device=dev)
    rows = []

    def timed(name, fn):
        rows.append((name, median_host_us(torch, dev, fn, args.repeats)))

    timed("torch's own h.to(dev, nb), 8 B (no syncless)", lambda: host.to(dev, non_blocking=True))
    timed("torch's own dst.copy_(h, nb), 8 B (no syncless)", lambda: dst.copy_(host, non_blocking=True))
    timed("dst.fill_(h.item()) (no copy)", lambda: dst.fill_(host.item()))
    timed("torch.full((1,), h.item(), device) (no copy)", lambda: torch.full((1,), host.item(), device=dev,
                                                                             dtype=torch.int64))
    timed("torch.empty(1, device)", lambda: torch.empty(1, dtype=torch.int64, device=dev))
    cc.install("emulate")
    lane = _fast._lane()
    entries = _inline_h2d.functions(0)
    timed("shim: inline h.to(dev, nb), 8 B", lambda: host.to(dev, non_blocking=True))
    timed("shim: inline dst.copy_(h, nb), 8 B", lambda: dst.copy_(host, non_blocking=True))
    timed("_inline_h2d.launch alone", lambda: _inline_h2d.launch(entries, dst.data_ptr(), host.data_ptr(), 8,
                                                                 lane.raw_stream(0)))
    timed("_raw.enter_context (current already)", lambda: _raw.enter_context(0))
    timed("lane checks + current stream + capturing", lambda: (lane.has_override(host), lane.dispatch_depth(),
                                                               lane.raw_stream(0), lane.capturing()))
    cc.uninstall()
    width = max(len(name) for name, _ in rows)
    for name, us in rows:
        print(f"{name:{width}s} {us:8.2f} us")


if __name__ == "__main__":
    main()

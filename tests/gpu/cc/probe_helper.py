"""The D2H helper process on its own (a probe, not a test): start it, hand it copies behind slow producers, time it.

    PYTHONPATH=src python3 tests/gpu/cc/probe_helper.py

Checks every copy's bytes (fresh random data, a ``torch.cuda._sleep`` before each snapshot so the helper must wait
for the ready event, not read the slot early) and prints the host time of a post and of a delivery.
"""

from __future__ import annotations

import statistics
import time


def main() -> None:
    import torch

    from syncless._core import libcuda
    from syncless.cc import _helper, _raw

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    libcuda.libraries()
    t0 = time.perf_counter()
    helper = _helper.D2HHelper(0)
    while not helper.is_usable():
        if helper.failed:
            raise SystemExit("helper failed to start")
        time.sleep(0.001)
    print(f"helper ready in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    stream = torch.cuda.Stream(dev)
    gen = torch.Generator(device=dev).manual_seed(7)
    bad = 0
    posts, delivers = [], []
    for round_ in range(300):
        count = 1 + round_ % 5
        jobs = []
        with torch.cuda.stream(stream):
            for k in range(count):
                n = int(torch.randint(1, 2048, (1,)).item())
                src = torch.randint(-2**62, 2**62, (n,), device=dev, dtype=torch.int64, generator=gen)
                if k == 0 and round_ % 3 == 0:
                    torch.cuda._sleep(200_000)  # a slow producer: the helper must wait for R[slot]
                src.add_(1)
                t = time.perf_counter()
                slot = helper.take_slot()
                _raw.copy_device_block(0, helper.ring_ptr(slot), src.data_ptr(), src.nbytes, stream)
                _raw.record_ready(helper.events[slot], stream)
                seq = helper.post(slot, src.nbytes)
                posts.append(time.perf_counter() - t)
                dst = torch.empty(n, dtype=torch.int64, pin_memory=True)
                jobs.append((slot, seq, dst, src))
        for slot, seq, dst, src in jobs:
            t = time.perf_counter()
            helper.deliver(slot, seq, dst.data_ptr(), dst.nbytes)
            delivers.append(time.perf_counter() - t)
            if not torch.equal(dst, src.cpu()):
                bad += 1
    print(f"copies {len(posts)}, wrong {bad}; post median {statistics.median(posts) * 1e6:.2f} us, "
          f"deliver median {statistics.median(delivers) * 1e6:.2f} us")
    helper.stop()
    print("stopped, exit code", helper.process.returncode)
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

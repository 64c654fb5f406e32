"""Does a D2H copy on one of syncless's private streams wait for unrelated work on another stream? (a probe, not a test)

Run on a GPU from the source tree::

    PYTHONPATH=src python3 tests/gpu/cc/probe_false_dependency.py [--streams 16] [--sleep-ms 2]

Streams that share one of the GPU's hardware work queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default) run
their work in one order: a copy on one waits behind a kernel queued earlier on the other, though nothing orders
them (a false dependency). For each "compute" stream (torch's current stream, a stream from torch's pool) and
each of ``--streams`` private streams made as ``cc.new_d2h_stream()`` makes them, this queues a kernel that
sleeps ``--sleep-ms`` on the compute stream, then an 8-byte D2H copy on the private stream, and times how long
the copy takes to finish: well under the sleep where the two streams are independent, about the sleep where they
share a queue. The worker's job of an offloaded readback makes its copy on such a stream right after the step's
ready event fired, while the next step's kernels are queued on the compute stream.
"""

from __future__ import annotations

import argparse
import os
import time


def _time_to_done(torch, quick, compute, stream, device_word, host_word, sleep_cycles) -> float:
    """Microseconds from enqueueing the copy until ``stream`` is done, with a sleep queued on ``compute`` first."""
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(sleep_cycles)
    start = time.perf_counter()
    code = quick.cuMemcpyDtoHAsync_v2(host_word.data_ptr(), device_word.data_ptr(), 8, stream.cuda_stream)
    assert code == 0, code
    while quick.cuStreamQuery(stream.cuda_stream) != 0:
        pass
    spent = (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--sleep-ms", type=float, default=2.0)
    args = parser.parse_args()

    import torch

    from syncless._core import libcuda
    from syncless.cc import _streams

    quick, _ = libcuda.libraries()
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    device_word = torch.arange(1, device=dev, dtype=torch.int64)
    host_word = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    # The sleep's cycles for --sleep-ms, calibrated on this GPU.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * args.sleep_ms / start.elapsed_time(end))
    computes = {"current (default)": torch.cuda.current_stream(dev), "torch pool": torch.cuda.Stream(dev),
                "torch pool, high priority": torch.cuda.Stream(dev, priority=-1)}
    candidates = {"private": [_streams.create_private_stream(0) for _ in range(args.streams)],
                  "torch pool, high priority": [torch.cuda.Stream(dev, priority=-1) for _ in range(4)]}
    print(f"sleep {args.sleep_ms} ms ({cycles} cycles); CUDA_DEVICE_MAX_CONNECTIONS="
          f"{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', '(unset: 8)')}")
    for name, compute in computes.items():
        for kind, streams in candidates.items():
            times = [_time_to_done(torch, quick, compute, stream, device_word, host_word, cycles)
                     for stream in streams if stream.cuda_stream != compute.cuda_stream]
            waited = sum(t > 500 * args.sleep_ms for t in times)
            print(f"compute {name!r}, copy on {kind}: {waited} of {len(times)} waited behind the sleep; "
                  f"copy done after (us): " + " ".join(f"{t:.0f}" for t in times))


if __name__ == "__main__":
    main()

"""Host microseconds of each piece of the shim's fast lane, on the GPU (a probe, not a test).

Run on a GPU from the source tree::

    PYTHONPATH=src python3 tests/gpu/cc/probe_lane_parts.py [--repeats 2000]

Under ``cc.install("emulate")``, times (median of ``--repeats``) every call the fast lane's offload
(``x.to("cpu", non_blocking=True)`` on a D2H stream) and staged upload (``h.to("cuda", non_blocking=True)``)
are made of, one at a time, next to the whole calls and torch's own, so the next cut goes where the time is.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()

    import torch

    import syncless.cc as cc
    from syncless.cc import _d2h, _fast, _host_writes, _inline_h2d, _raw, _shim, _staging, _streams

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cc.install("emulate")
    d2h = cc.new_d2h_stream(dev)
    record = _d2h.lookup(d2h)
    current = torch.cuda.current_stream(dev)
    staging = _streams.staging_stream(0)
    tokens = torch.arange(8, device=dev)
    host = torch.zeros(8, dtype=torch.int64).pin_memory()
    lane = _fast._lane()
    rows = []

    def timed(name, fn, setup=None):
        samples = []
        for _ in range(args.repeats):
            state = setup() if setup else None
            t0 = time.perf_counter()
            fn(state) if setup else fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        rows.append((name, statistics.median(samples)))

    snap = torch.empty_like(tokens)
    timed("torch.empty_strided pinned 8 int64", lambda: torch.empty_strided((8,), (1,), dtype=torch.int64,
                                                                            pin_memory=True))
    timed("_d2h.pinned_block", lambda: _d2h.pinned_block(tokens, tokens.dtype))
    timed("torch.empty_like(device tensor)", lambda: torch.empty_like(tokens))
    timed("raw D2D copy_device_block", lambda: _raw.copy_device_block(0, snap.data_ptr(), tokens.data_ptr(),
                                                                            64, d2h))

    def ready_cycle():
        event = _raw.take_ready_event(0)
        _raw.record_ready(event, d2h)
        _raw.give_back_ready_event(0, event)

    timed("take+record+give back a ready event", ready_cycle)
    worker = record.worker
    timed("worker.submit (job run after, untimed)", lambda: worker.wait_for(worker.submit(lambda: None,
                                                                                           eager=False)))
    timed("worker.wait_for of a trivial job (submit untimed)", lambda s: worker.wait_for(s),
          setup=lambda: worker.submit(lambda: None, eager=False))
    timed("_host_writes.note_offloaded_d2h", lambda: _host_writes.note_offloaded_d2h(
        torch.empty(8, dtype=torch.int64, pin_memory=True), (worker, worker.submitted)))
    timed("lane checks (override, modes, functorch)", lambda: (lane.has_override(tokens), lane.dispatch_depth(),
                                                                lane.functorch_peek(), lane.functorch_wrapped(tokens)))
    timed("raw current stream + device + capturing", lambda: (lane.raw_stream(0), lane.current_device(),
                                                               lane.capturing()))
    timed("tensor facts (layout, nested, contiguous, conj, nbytes)", lambda: _fast._plain_block(lane, tokens, 1 << 26))
    with torch.cuda.stream(d2h):
        timed("WHOLE lane offload tokens.to('cpu', nb)", lambda: tokens.to("cpu", non_blocking=True))
        torch.cuda.synchronize()
        d2h.synchronize()
    cc.uninstall()
    timed("torch's own tokens.to('cpu', nb) (no syncless)", lambda: tokens.to("cpu", non_blocking=True))
    cc.install("emulate")
    d2h = cc.new_d2h_stream(dev)
    timed("torch.cuda.set_stream x2", lambda: (torch.cuda.set_stream(staging), torch.cuda.set_stream(current)))
    timed("_streams._set_stream x2", lambda: (_streams._set_stream(staging), _streams._set_stream(current)))
    timed("_streams.current_stream(0)", lambda: _streams.current_stream(0))
    timed("cuStreamSynchronize idle staging (wait_stream_raw)", lambda: _streams.wait_stream_raw(staging))
    timed("order_after(current, staging)", lambda: _streams.order_after(current, staging))
    landed = host.to(dev)
    timed("record_stream", lambda: landed.record_stream(current))
    timed("host_writes.order_after_pending_writes", lambda: _host_writes.order_after_pending_writes(staging, host))
    own_to = _staging._torch_own("to")

    def staging_copy():
        _streams._set_stream(staging)
        own_to(host, device=dev, non_blocking=True)
        _streams._set_stream(current)

    timed("torch's .to on staging (set_stream in/out)", staging_copy)
    timed("WHOLE inline h.to('cuda', nb) 8 B", lambda: host.to(dev, non_blocking=True))
    entries = _inline_h2d.functions(0)
    timed("_inline_h2d.launch 64 B alone (the kernel)", lambda: _inline_h2d.launch(
        entries, landed.data_ptr(), host.data_ptr(), 64, lane.raw_stream(0), 0))
    timed("_inline_h2d.launch 8 B alone (a word write where the GPU has them)", lambda: _inline_h2d.launch(
        entries, landed.data_ptr(), host.data_ptr(), 8, lane.raw_stream(0), 0))
    timed("WHOLE inline dst.copy_(h, nb) 8 B", lambda: landed.copy_(host, non_blocking=True))
    # The driver's own cost per call, for the next cut: a stream memory op that carries 8 bytes in the command
    # (cuStreamWriteValue64) against the inline kernel's launch, and a bare stream query.
    import ctypes

    from syncless._core import libcuda

    quick = libcuda.libraries()[0]
    write_value = quick.cuStreamWriteValue64_v2
    write_value.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
    write_value.restype = ctypes.c_int
    handle = lane.raw_stream(0)
    word = torch.empty(1, dtype=torch.int64, device=dev)
    value = 0x0123456789ABCDEF

    def write_word():
        code = write_value(handle, word.data_ptr(), value, 0)
        if code:
            raise RuntimeError(f"cuStreamWriteValue64: {code}")

    timed("raw cuStreamWriteValue64 8 B (the driver alone)", write_word)
    torch.cuda.synchronize()
    print(f"cuStreamWriteValue64 wrote the value exactly: {int(word.item()) == value}")
    query = quick.cuStreamQuery
    timed("raw cuStreamQuery of the current stream", lambda: query(handle))
    _shim._STATE.inline_max_bytes = 0
    torch.cuda._sleep(400_000_000)  # ~0.2 s of queued work, so that the upload is staged rather than torch's own
    timed("WHOLE staged h.to('cuda', nb) 8 B (inline off)", lambda: host.to(dev, non_blocking=True))
    torch.cuda.synchronize()
    cc.uninstall()
    timed("torch's own h.to('cuda', nb) 8 B (no syncless)", lambda: host.to(dev, non_blocking=True))
    timed("torch.cuda.Event() + record (no syncless)", lambda: torch.cuda.Event().record(current))
    cc.install("emulate")
    timed("torch.cuda.Event() + record (shim)", lambda: torch.cuda.Event().record(current))
    cc.uninstall()
    width = max(len(name) for name, _ in rows)
    for name, us in rows:
        print(f"{name:{width}s} {us:8.2f} us")


if __name__ == "__main__":
    main()

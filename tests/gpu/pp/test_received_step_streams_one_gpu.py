"""A deferred step read on several streams: each one must see the step's data (two stages on cuda:0).

Issue 34 item 9: ``ReceivedStep.wait(stream)`` ordered only the first stream; a later ``wait(s2)``,
or a key read under another current stream, returned the views with nothing ordering that stream
after the copy-in, and a reader there read the old value. Here the sender holds its stream (a sleep
kernel) before each step, so the data lands late; the receiver finishes the step on one stream,
then reads it on a second one (through ``wait(s2)``) and a third (current while it reads a key).
"""

from __future__ import annotations

import pytest
import torch

from support.ranks import run_ranks, say

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

ROWS, WIDTH = 4096, 1024
STEPS = 12
SENDER_HOLD_CYCLES = 50_000_000  # tens of milliseconds: the readers are queued long before the data lands


def read_on_other_streams(rank: int, world: int, backend: str, depth) -> dict:
    import torch.distributed as dist

    from syncless.pp import alloc_persistent, make_transport

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    persistent = None
    if rank == 1:
        persistent = (alloc_persistent({"hidden": ((ROWS, WIDTH), torch.float32)}, device) if depth in (0, "auto")
                      else {"hidden": torch.empty(ROWS, WIDTH, device=device)})
    transport = make_transport(None, persistent, backend=backend, depth=depth, timeout_s=60, device=device)
    source = torch.empty(ROWS, WIDTH, device=device) if rank == 0 else None
    streams = [torch.cuda.Stream(device) for _ in range(3)]
    seen = {"wait(s2)": [], "current s3": []}
    for step in range(1, STEPS + 1):
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            torch.cuda._sleep(SENDER_HOLD_CYCLES)
            source.fill_(float(step))
            transport.send({"hidden": source})
            continue
        persistent["hidden"].fill_(-1.0)  # on the receiving stream, before recv(): the old value
        out = transport.recv(wait=False)
        out.wait(streams[0])
        views = out.wait(streams[1])
        with torch.cuda.stream(streams[1]):
            second = views["hidden"][-1:, -1:].clone()
        with torch.cuda.stream(streams[2]):
            third = out["hidden"][-1:, -1:].clone()
        torch.cuda.synchronize()
        seen["wait(s2)"].append(float(second))
        seen["current s3"].append(float(third))
    torch.cuda.synchronize()
    dist.barrier()
    transport.close()
    if rank == 1:
        say(f"{backend} depth {depth!r}: {seen}")
    return seen


@pytest.mark.parametrize(("backend", "depth"), [("copy_engine", 2), ("copy_engine", 0), ("copy_engine", "auto"),
                                                ("torch_distributed", 2)])
def test_every_stream_that_reads_a_deferred_step_sees_its_data(backend, depth):
    seen = run_ranks(read_on_other_streams, 2, args=(backend, depth), devices=[0, 0], backend="gloo",
                     timeout_s=240)[1]
    expected = [float(step) for step in range(1, STEPS + 1)]
    assert seen == {"wait(s2)": expected, "current s3": expected}

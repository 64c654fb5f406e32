"""Rank bodies of the ``depth="auto"`` GPU tests (one GPU and two), beside ``pp_cases``.

Each body runs in every rank (``support.ranks.run_ranks``), prints its progress, and returns what the
parent asserts on. CUDA only.
"""

from __future__ import annotations

import importlib.util
import pathlib

import torch
import torch.distributed as dist

from support.ranks import say
from syncless.pp import make_transport

_spec = importlib.util.spec_from_file_location("pp_cases", pathlib.Path(__file__).with_name("pp_cases.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def symmetric_exchange(rank, world, steps, max_rows=64, seed=2468, timeout_s=20.0):
    """Two transports in opposite directions; each rank sends step N, then receives step N, on one stream.

    Under ``depth=0`` this waits until the timeout (both sends wait for the other's recv()); under
    ``depth="auto"`` it must finish, with every step bit-exact: a direct step needs the receiver to have
    posted its recv(), and a step nobody posted for goes through a slot. The timeout is short, so a
    wait cycle shows up as ``PeerTimeoutError`` well within the test's limit.
    """
    device = cases._device("cuda")
    mine = cases._persistent(device, max_rows, own_allocation=True)  # what the other rank sends into
    # Transport 0 -> 1 (rank 1 receives), then 1 -> 0 (rank 0 receives): every rank calls both, in this order.
    forward = make_transport(None, mine if rank == 1 else None, stage_ranks=[0, 1], backend="copy_engine",
                             timeout_s=timeout_s, device=device, depth="auto")
    backward = make_transport(None, mine if rank == 0 else None, stage_ranks=[1, 0], backend="copy_engine",
                              timeout_s=timeout_s, device=device, depth="auto")
    out, into = (forward, backward) if rank == 0 else (backward, forward)
    if out.direct_unavailable_reason is not None:
        raise AssertionError(f"alloc_persistent tensors should be shareable: {out.direct_unavailable_reason}")
    bad = torch.zeros((), dtype=torch.int64, device=device)
    for step in range(1, steps + 1):
        out.send(cases.expected(seed + rank, step, max_rows, device))
        got = into.recv()
        bad += cases._mismatches(got, cases.expected(seed + 1 - rank, step, max_rows, device))
        for tensor in mine.values():  # the reader is done with step N before recv(N+1): poison behind it
            cases._poison(tensor)
        if step % 100 == 0 or step == steps:
            say(f"rank {rank}: {step}/{steps} steps exchanged, {int(bad)} mismatching elements so far")
    torch.cuda.synchronize()
    direct = out.direct_steps_sent
    say(f"rank {rank}: {direct} of {steps} sends went direct")
    dist.barrier()
    forward.close()
    backward.close()
    return {"mismatches": int(bad), "steps": steps, "direct_steps": direct,
            "leaked_nbytes": forward.leaked_nbytes + backward.leaked_nbytes}


def not_shareable(rank, world, steps=200, max_rows=32, seed=1357):
    """Persistent tensors from torch's caching allocator: no error, every step through a slot, the reason kept."""
    device = cases._device("cuda")
    persistent = None if rank == 0 else cases._persistent(device, max_rows)  # torch.empty: a shared segment
    transport = make_transport(None, persistent, backend="copy_engine", timeout_s=30, device=device, depth="auto")
    reason = transport.direct_unavailable_reason
    say(f"rank {rank}: depth={transport.depth!r} slots={transport.auto_slots} reason: {reason}")
    bad = torch.zeros((), dtype=torch.int64, device=device)
    for step in range(1, steps + 1):
        cases.auto_host_pause(step, sender=rank == 0)  # paced as elsewhere: steps would go direct if they could
        if rank == 0:
            transport.send(cases.expected(seed, step, max_rows, device))
        else:
            bad += cases._mismatches(transport.recv(), cases.expected(seed, step, max_rows, device))
    torch.cuda.synchronize()
    dist.barrier()
    direct = transport.direct_steps_sent
    transport.close()
    return {"reason": reason, "depth": transport.depth, "slots": transport.auto_slots, "mismatches": int(bad),
            "direct_steps": direct, "leaked_nbytes": transport.leaked_nbytes}

"""A pipeline with a link back, rebuilt, on three CPU ranks over gloo (runs in CI, no GPU).

One launch (three spawned ranks, a hard timeout) plays what docs/pp.md's link-back recipe leads to:
the forward transport, a link back over the two end stages, then the forward transport rebuilt
twice on the same ranks while the link back lives (the second time through a stand-in of vLLM's
``GroupCoordinator``, with the first stage's ``device="cpu:0"``), each carrying 100 steps bit for
bit; then a ``recv()`` blocked on one thread, ended by ``abort()`` or ``close()`` on another.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from support.ranks import run_ranks, say

pytestmark = pytest.mark.timeout(200)

MAX_ROWS = 8
WIDTH = 5
STEPS = 100
TIMEOUT_S = 10.0  # a set-up that cannot rendezvous fails after this, well inside the launch's timeout


class Coordinator:
    """What make_transport reads of vLLM's (and SGLang's) ``GroupCoordinator``: its two process groups."""

    def __init__(self, cpu_group, device_group):
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.ranks = [0, 1, 2]


def _step(seed: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    rows = int(torch.randint(0, MAX_ROWS + 1, (), generator=gen))
    return {"hidden": torch.randn((rows, WIDTH), generator=gen),
            "ids": torch.randint(-(2**40), 2**40, (int(torch.randint(1, MAX_ROWS + 1, (), generator=gen)),),
                                 generator=gen)}


def _forward_round(rank: int, transport, seed: int) -> int:
    """100 steps 0 -> 1 -> 2; the middle stage forwards what it got; return the mismatches seen here."""
    wrong = 0
    for step in range(1, STEPS + 1):
        if rank == 0:
            transport.send(_step(seed, step))
            continue
        out = transport.recv()
        want = _step(seed, step)
        wrong += sorted(out) != sorted(want) or not all(
            out[k].shape == want[k].shape and torch.equal(out[k].view(torch.uint8), want[k].view(torch.uint8))
            for k in want
        )
        if rank == 1:
            transport.send(out)
    return wrong


def _blocked_recv_ended_by(transport, stop: str) -> str:
    """Block in recv() (nobody sends) while another thread calls ``stop``; return what recv() raised."""
    def later():
        time.sleep(0.3)
        getattr(transport, stop)()

    thread = threading.Thread(target=later)
    thread.start()
    try:
        transport.recv()
    except Exception as err:  # noqa: BLE001 - the test reports which error it was
        outcome = f"{type(err).__name__}: {err}"
    else:
        outcome = "returned"
    thread.join()
    return outcome


def link_back_and_rebuild(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from syncless.pp import make_transport

    persistent = None if rank == 0 else {"hidden": torch.full((MAX_ROWS, WIDTH), float("nan")),
                                         "ids": torch.full((MAX_ROWS,), -7, dtype=torch.int64)}
    result: dict = {"wrong": []}
    forward = make_transport(None, persistent, timeout_s=TIMEOUT_S)
    result["wrong"].append(_forward_round(rank, forward, seed=1))
    ends = dist.new_group([0, 2])  # docs/pp.md's recipe: every rank calls new_group, only the ends build on it
    tokens = None
    if rank in (0, 2):
        ids = {"ids": torch.zeros(MAX_ROWS, dtype=torch.int64)} if rank == 0 else None
        tokens = make_transport(ends, ids, stage_ranks=[2, 0], depth=2, timeout_s=TIMEOUT_S)
        for step in range(1, MAX_ROWS + 1):
            if rank == 2:
                tokens.send({"ids": torch.arange(step)})
            elif not torch.equal(tokens.recv()["ids"], torch.arange(step)):
                result["wrong"].append(f"token step {step}")
    say("link back carried its steps; rebuilding the forward transport")
    forward.close()
    forward = make_transport(None, persistent, timeout_s=TIMEOUT_S)  # docs/pp.md: "the same group works"
    result["wrong"].append(_forward_round(rank, forward, seed=2))
    forward.close()
    coordinator = Coordinator(dist.new_group(backend="gloo"), dist.group.WORLD)
    forward = make_transport(coordinator, persistent, timeout_s=TIMEOUT_S,  # the guide's make_transport(pp_group, ...)
                             device="cpu:0" if rank == 0 else None)
    result["wrong"].append(_forward_round(rank, forward, seed=3))
    say("rebuilt twice; now a blocked recv() ended from another thread")
    if rank == 2:  # the others keep their ends open meanwhile (a peer that closes ends the wait as well)
        result["close"] = _blocked_recv_ended_by(forward, "close")
    dist.barrier()
    if rank != 2:
        forward.close()
    if rank == 0:
        result["abort"] = _blocked_recv_ended_by(tokens, "abort")
    dist.barrier()
    if tokens is not None:
        tokens.close()
    try:
        make_transport(object(), persistent)
    except TypeError as err:
        result["not_a_group"] = str(err)
    return result


def test_the_forward_transport_rebuilds_after_a_link_back_and_a_blocked_recv_ends_at_abort_or_close():
    results = run_ranks(link_back_and_rebuild, 3, backend="gloo", timeout_s=180)
    assert [r["wrong"] for r in results] == [[0, 0, 0]] * 3
    # Ended by the other thread's call, with its error: not the PeerTimeoutError of a wait that ran out.
    assert results[2]["close"].startswith("TransportClosedError:"), results[2]["close"]
    assert results[0]["abort"].startswith("TransportFailedError:") and "aborted" in results[0]["abort"]
    assert "cpu_group and device_group" in results[1]["not_a_group"]

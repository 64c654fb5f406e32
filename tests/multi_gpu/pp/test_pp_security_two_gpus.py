"""What a depth=0 neighbour can reach, and local strangers during a real set-up, on two GPUs.

Each test spawns two ranks (GPUs 0 and 1) with a hard timeout; run with -s to
watch their progress.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time

import pytest
import torch

from support.ranks import run_ranks, say

pytestmark = [pytest.mark.multi_gpu(count=2), pytest.mark.timeout(240)]

SPECS = {"hidden": ((64, 1024), torch.bfloat16), "ids": ((64,), torch.int64)}
STEPS = 200


def _step_data(seed, step, device):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + step)
    rows = random.Random(seed + step).randint(1, 64)
    return {
        "hidden": torch.randn((rows, 1024), generator=gen, device=device).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (rows,), generator=gen, device=device),
    }


def _bits_differ(a, b):
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def isolated_depth_0(rank, world, seed):
    """Rank 1 receives at depth 0 into alloc_persistent tensors, between two tensors of torch's allocator."""
    from syncless.pp import _driver as drv
    from syncless.pp import alloc_persistent, make_transport

    device = torch.device("cuda", torch.cuda.current_device())
    out = {}
    persistent = neighbour = before = None
    if rank == 1:
        before = torch.empty(4096, dtype=torch.uint8, device=device)  # torch's allocator, just before
        persistent = alloc_persistent(SPECS, device)
        neighbour = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=device)  # and just after
        neighbour_copy = neighbour.clone()
        for t in persistent.values():
            t.view(torch.uint8).fill_(0xFF)
        base, size = drv.allocation_of(persistent["hidden"].data_ptr())
        out["allocation_nbytes"] = size
        out["offsets"] = [persistent[name].data_ptr() - base for name in SPECS]
        for name, tensor in (("before", before), ("neighbour", neighbour)):
            other_base, other_size = drv.allocation_of(tensor.data_ptr())
            out[f"{name}_in_other_allocation"] = other_base != base and not (
                base <= tensor.data_ptr() < base + size or other_base <= base < other_base + other_size
            )
        say(f"receiver: own allocation of {size} bytes; neighbour in another: {out['neighbour_in_other_allocation']}")
    transport = make_transport(None, persistent, backend="copy_engine", depth=0, timeout_s=60, device=device)
    out["backend"] = transport.backend
    if rank == 0:
        # What this process mapped of the receiver: each target's allocation, as the driver sees it here.
        with transport._ctx:
            mapped = [drv.allocation_of(addr) for addr in transport._parts.next_targets]
        out["mapped"] = sorted({m for m in mapped})
        out["offsets"] = [addr - mapped[0][0] for addr in transport._parts.next_targets]
        for step in range(1, STEPS + 1):
            transport.send(_step_data(seed, step, device))
    else:
        bad = 0
        for step in range(1, STEPS + 1):
            got = transport.recv()
            expected = _step_data(seed, step, device)
            bad += sum(_bits_differ(got[name], expected[name]) for name in SPECS)
        torch.cuda.synchronize()
        out["mismatches"] = bad
        out["neighbour_untouched"] = bool(torch.equal(neighbour, neighbour_copy))
    torch.cuda.synchronize()
    transport.close()
    return out


def test_a_depth_0_neighbour_maps_exactly_the_persistent_allocation_and_nothing_next_to_it():
    sender, receiver = run_ranks(isolated_depth_0, 2, args=(4242,), devices=[0, 1], timeout_s=180)
    assert sender["backend"] == receiver["backend"] == "copy_engine"
    assert receiver["before_in_other_allocation"] and receiver["neighbour_in_other_allocation"]
    # The peer mapped one allocation, exactly as large as the one alloc_persistent made, at the same offsets.
    assert len(sender["mapped"]) == 1 and sender["mapped"][0][1] == receiver["allocation_nbytes"]
    assert sender["offsets"] == receiver["offsets"]
    assert receiver["mismatches"] == 0 and receiver["neighbour_untouched"]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def shared_segment_refused(rank, world):
    """Rank 1's persistent tensors come from torch.empty (small: they share a caching-allocator segment)."""
    from syncless.pp import CopyEngineUnavailable, make_transport

    device = torch.device("cuda", torch.cuda.current_device())
    persistent = None
    if rank == 1:
        # Under 1 MiB each: torch's caching allocator places them in a 2 MiB segment it shares with others.
        persistent = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in SPECS.items()}
    out = {}
    try:
        make_transport(None, persistent, backend="copy_engine", depth=0, timeout_s=60, device=device)
        out["copy_engine"] = "built"
    except CopyEngineUnavailable as err:
        out["copy_engine"] = str(err)
    transport = make_transport(None, persistent, backend="auto", depth=0, timeout_s=60, device=device)
    out["auto_backend"] = transport.backend
    out["fallback_reason"] = transport.fallback_reason
    transport.close()
    return out


def test_persistent_tensors_sharing_a_caching_allocator_segment_are_refused_with_the_reason():
    results = run_ranks(shared_segment_refused, 2, devices=[0, 1], backend="cpu:gloo,cuda:nccl", timeout_s=180)
    for out in results:  # the same answer on both ranks
        assert "whole allocation holding persistent" in out["copy_engine"], out
        assert "alloc_persistent" in out["copy_engine"] and "stage 1 (rank 1)" in out["copy_engine"], out
        assert out["auto_backend"] == "torch_distributed"
        assert "alloc_persistent" in out["fallback_reason"]


def _strangers(stop):
    """Connect to every syncless metadata socket that appears: silent, garbage, and a replayed answer."""
    from syncless.pp import _meta_channel as meta_channel

    held = []
    seen = set()
    while not stop.is_set():
        try:
            with open("/proc/net/unix") as table:
                names = [line.split()[-1] for line in table if "@syncless-pp-" in line]
        except OSError:
            names = []
        for name in names:
            if name in seen:
                continue
            seen.add(name)
            address = "\0" + name[1:]
            try:
                silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                silent.connect(address)
                garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                garbage.connect(address)
                garbage.sendall(os.urandom(meta_channel.ANSWER_NBYTES))
                replay = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                replay.connect(address)
                replay.sendall(b"\0" * meta_channel.TOKEN_NBYTES)  # a token-style frame, as the old protocol took
                held += [silent, garbage, replay]
            except OSError:
                pass  # the listener is already gone: nothing to attack
        time.sleep(0.001)
    for sock in held:
        sock.close()


def set_up_under_attack(rank, world, seed):
    """Rank 1 (the receiver) runs a stranger thread hammering its metadata socket during set-up."""
    from syncless.pp import alloc_persistent, make_transport

    device = torch.device("cuda", torch.cuda.current_device())
    records = _Records()
    logging.getLogger("syncless.pp._meta_channel").addHandler(records)
    logging.getLogger("syncless.pp._meta_channel").setLevel(logging.WARNING)
    stop = threading.Event()
    attacker = None
    persistent = None
    if rank == 1:
        persistent = alloc_persistent(SPECS, device)
        attacker = threading.Thread(target=_strangers, args=(stop,), daemon=True)
        attacker.start()
    start = time.monotonic()
    transport = make_transport(None, persistent, backend="copy_engine", depth=0, timeout_s=30, device=device)
    set_up_s = time.monotonic() - start
    stop.set()
    if attacker is not None:
        attacker.join(10)
    say(f"rank {rank}: set-up took {set_up_s:.2f} s with a 30 s timeout")
    bad = 0
    for step in range(1, STEPS + 1):
        if rank == 0:
            transport.send(_step_data(seed, step, device))
        else:
            got = transport.recv()
            expected = _step_data(seed, step, device)
            bad += sum(_bits_differ(got[name], expected[name]) for name in SPECS)
    torch.cuda.synchronize()
    transport.close()
    return {"set_up_s": set_up_s, "mismatches": bad, "refusals": records.messages}


def test_set_up_and_steps_run_in_normal_time_while_a_stranger_attacks_the_metadata_socket():
    results = run_ranks(set_up_under_attack, 2, args=(99,), devices=[0, 1], timeout_s=180)
    for out in results:
        assert out["set_up_s"] < 15, out["set_up_s"]  # far below the 30 s timeout (normal: a few seconds)
    assert results[1]["mismatches"] == 0
    # The receiver logged the strangers (whether they came before or after the sender's answer).
    assert any("refused a connection" in m for m in results[1]["refusals"]), results[1]["refusals"]

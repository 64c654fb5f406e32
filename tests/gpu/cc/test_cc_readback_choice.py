"""Issue 33 on a GPU: the way a small readback takes where the host waits for it (the look, or the offload),
chosen by timing the loop both ways (``syncless.cc._readback_choice``), in two loops whose pace is set clearly by
one side, and every token exact through the trials and switches.

Each step writes 8 fresh random int64 tokens on the GPU (a row of a pool made with a seeded generator, kept on the
host too), reads them back on a D2H stream with ``.to("cpu", non_blocking=True)``, records an event, and reads the
previous step's tokens after synchronizing its event (one step late, as a decode loop does). Under emulated CC with
the shim (``emulated_cc``). The look is given 5 ms here (``DRAIN_LOOK_S``), so that the look's way really reads
every readback at the call and the trials compare the two ways themselves.
"""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

STEPS = 1500
POOL = 64


def _spin(seconds: float) -> None:
    """The host's own work in a step (a scheduler's Python), holding the GIL."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _run_loop(cc, cycles_per_ms, host_us_before: float, gpu_us: float, host_us_after: float, seed: int):
    """``STEPS`` steps of: host work, a GPU kernel of ``gpu_us``, host work, the readback; the tokens checked one step
    late. Returns the D2H stream's choice and how many readbacks the last third read at the call."""
    import torch

    from syncless.cc import _d2h

    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(seed)
    pool = torch.randint(-(2 ** 62), 2 ** 62, (POOL, 8), dtype=torch.int64, device=dev, generator=gen)
    expected = pool.cpu()
    tokens = torch.zeros(8, dtype=torch.int64, device=dev)
    d2h = cc.new_d2h_stream(dev)
    choice = _d2h.lookup(d2h).choice
    current = torch.cuda.current_stream(dev)
    pending = None
    at_call_late = 0
    try:
        for index in range(STEPS):
            if index == 2 * STEPS // 3:
                cc.reset_stats()
            _spin(host_us_before * 1e-6)
            torch.cuda._sleep(int(cycles_per_ms * gpu_us / 1000))
            tokens.copy_(pool[index % POOL])
            _spin(host_us_after * 1e-6)
            d2h.wait_stream(current)
            with torch.cuda.stream(d2h):
                host = tokens.to("cpu", non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(d2h)
            if pending is not None:
                pending[1].synchronize()
                assert torch.equal(pending[0], expected[(index - 1) % POOL]), f"step {index - 1}: wrong tokens"
            pending = (host, ready)
        pending[1].synchronize()
        assert torch.equal(pending[0], expected[(STEPS - 1) % POOL])
        at_call_late = cc.stats().left_alone.get("idle_stream", 0)
    finally:
        torch.cuda.synchronize(dev)
        cc.close_d2h_stream(d2h)
    return choice, at_call_late


@pytest.fixture
def long_look(monkeypatch):
    from syncless.cc import _fast

    monkeypatch.setattr(_fast, "DRAIN_LOOK_S", 5e-3)


def test_a_loop_whose_gpu_sets_the_pace_is_offloaded(emulated_cc, cycles_per_ms, long_look):
    # The host's 150 us come before the step's 600 us kernel: read back at the call, the GPU idles through them
    # each step (about 750 us a step); offloaded, the host is ready with the next kernel before the GPU is done
    # (about 600 us a step). (With a 300 us kernel a loaded host's own step, its 150 us and the offload's calls,
    # came near the kernel's time in run 82, and a later trial took the look back.)
    choice, at_call = _run_loop(emulated_cc, cycles_per_ms, 150.0, 600.0, 0.0, seed=1)
    assert choice.trials >= 2 and choice.switches >= 1
    assert choice.way is True, (choice.trials, choice.switches)  # OFFLOAD
    assert at_call < STEPS // 3 // 4, at_call  # the last third mostly offloaded (trials of the look aside)


def test_a_loop_whose_host_sets_the_pace_reads_back_at_the_call(emulated_cc, cycles_per_ms, long_look):
    # A 20 us kernel, then 300 us of the host's own work: the stream has drained at every readback, and an offload
    # would only add its own calls to the host's step.
    choice, at_call = _run_loop(emulated_cc, cycles_per_ms, 0.0, 20.0, 300.0, seed=2)
    assert choice.trials >= 2
    assert choice.way is False, (choice.trials, choice.switches)  # LOOK
    assert at_call > STEPS // 3 * 3 // 4, at_call

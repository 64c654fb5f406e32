"""`syncless bench cc` says clearly that it needs a GPU."""

import argparse

import pytest
import torch

from syncless._core.errors import MissingDependencyError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_cc_needs_a_gpu():
    from syncless.bench import _cc

    with pytest.raises(MissingDependencyError, match="needs a CUDA GPU"):
        _cc.run(argparse.Namespace(out=None, quick=True), lambda message: None)


def test_the_host_bound_rounds_run_every_setup_once_each_in_a_rotated_order():
    from syncless.bench import _cc

    setups = _cc.HOST_BOUND_SETUPS
    orders = [_cc.rotated(setups, index) for index in range(len(setups))]
    assert all(sorted(order) == sorted(setups) for order in orders)  # each round runs every setup once
    assert sorted(order[0] for order in orders) == sorted(setups)  # each setup runs first in one round of len()
    assert orders[0] == setups and _cc.rotated(setups, len(setups)) == setups


def test_the_host_bound_rows_run_their_rounds_in_the_rotated_orders(monkeypatch):
    """What ``_host_bound_rows`` runs, with the loop and the readback stood in for: ``rounds`` rounds of each, each
    running every setup once, in round ``i``'s rotated order; the rates and samples kept per setup."""
    from types import SimpleNamespace

    from syncless.bench import _cc, _cc_hostbound

    ran = []
    monkeypatch.setattr(_cc, "_enter", lambda setup: ran.append(("enter", setup)))
    monkeypatch.setattr(_cc_hostbound, "build_step", lambda torch, dev: SimpleNamespace(gpu_us=lambda: 300.0))
    import syncless.cc as cc

    def decode_loop(torch, dev, step, d2h, steps, warmup, floor, waits, launches, stream_waits):
        ran.append(("loop", floor, d2h, launches))
        waits.append((90.0 if floor else 5.0) + launches)  # the host's wait at the late sync, per setup and loop
        stream_waits.append(2.0 * launches + (1.0 if floor else 0.0))  # and its time in wait_stream
        return 1000.0 + launches

    monkeypatch.setattr(_cc_hostbound, "decode_loop", decode_loop)
    monkeypatch.setattr(_cc_hostbound, "readback_step_samples",
                        lambda torch, dev, d2h, steps, floor: ran.append(("readback", floor, d2h)) or [10.0])
    made = iter(["the host-bound loop's own D2H stream", "the GPU-paced loop's own D2H stream",
                 "the readback's own D2H stream"])
    monkeypatch.setattr(cc, "new_d2h_stream", lambda dev: next(made))
    rounds = 7
    rates, readback, _, late_sync, in_wait_stream = _cc._host_bound_rows(None, None, False, rounds,
                                                                         lambda message: None)
    setups = _cc.HOST_BOUND_SETUPS
    entered = [call[1] for call in ran if call[0] == "enter"]
    expected = [setup for index in range(rounds) for setup in _cc.rotated(setups, index)]
    assert entered == expected * 2  # the loop's rounds, then the readback's, both rotated
    assert all(len(rates[loop][setup]) == rounds for loop in _cc.LOOPS for setup in setups)
    assert set(readback) == set(setups)
    loops = [call for call in ran if call[0] == "loop"]
    # each setup runs the host-bound loop, then the GPU-paced one; the floor's wait only in its own rows
    assert [call[1] for call in loops] == [setup == _cc.FLOOR_SETUP for setup in expected for _ in _cc.LOOPS]
    assert [call[3] for call in loops] == [_cc_hostbound.EAGER_LAUNCHES, _cc_hostbound.GPU_PACED_LAUNCHES] * len(
        expected)
    assert _cc_hostbound.GPU_PACED_LAUNCHES < _cc_hostbound.EAGER_LAUNCHES
    # each loop and the readback on a D2H stream of its own (its way chosen by timing that loop alone; not the 3 ms
    # loop's stream, whose trials would hand their way on)
    assert [call[2] for call in loops] == ["the host-bound loop's own D2H stream",
                                           "the GPU-paced loop's own D2H stream"] * len(expected)
    assert {call[2] for call in ran if call[0] == "readback"} == {"the readback's own D2H stream"}
    assert late_sync == {loop: {setup: (90.0 if setup == _cc.FLOOR_SETUP else 5.0) + launches for setup in setups}
                         for loop, launches in _cc.LOOPS.items()}
    assert in_wait_stream == {loop: {setup: 2.0 * launches + (setup == _cc.FLOOR_SETUP) for setup in setups}
                              for loop, launches in _cc.LOOPS.items()}
    assert rates[_cc.GPU_PACED_LOOP]["plain"] == [1000.0 + _cc_hostbound.GPU_PACED_LAUNCHES] * rounds


def test_each_shim_rounds_progress_line_says_what_the_shim_did_with_its_readbacks(monkeypatch):
    from types import SimpleNamespace

    from syncless.bench import _cc
    from syncless.cc import _d2h
    from syncless.cc._readback_choice import OFFLOAD, ReadbackChoice

    choice = ReadbackChoice()
    choice.way, choice.trials, choice.switches = OFFLOAD, 3, 1
    monkeypatch.setattr(_d2h, "lookup", lambda stream: SimpleNamespace(choice=choice) if stream == "d2h" else None)
    cc = SimpleNamespace(stats=lambda: SimpleNamespace(offloaded=338, left_alone={"idle_stream": 2}))
    assert _cc._readbacks_done(cc, "d2h") == " (offloaded 338, read at the call 2, way offload (trials 3, switches 1))"
    # the D2H helper's copies take no way; a stream the shim does not know has none
    assert _cc._readbacks_done(cc, "d2h", with_way=False) == " (offloaded 338, read at the call 2)"
    assert _cc._readbacks_done(cc, "other") == " (offloaded 338, read at the call 2)"
    # after a trial, its step per way (median / mean, us)
    choice.last_trial = {OFFLOAD: (420e-6, 431.4e-6), not OFFLOAD: (401.2e-6, 409.6e-6)}
    assert _cc._readbacks_done(cc, "d2h") == (" (offloaded 338, read at the call 2, way offload (trials 3, switches 1; "
                                              "last trial us median/mean: look 401/410, offload 420/431))")

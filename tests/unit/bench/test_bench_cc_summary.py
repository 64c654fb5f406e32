"""`syncless bench cc`'s tables and goals, from made-up measurements (CPU only).

The GPU parts (the calibrated spin, the decode loop, the timed H2D) are
replaced by fakes that return fixed numbers for the setup last entered; the
aggregation, the tables and the goals are the real code.
"""

import argparse
import statistics
import types

import pytest

import syncless.cc as cc
from syncless.bench import _cc

#: tokens/s per round (5 rounds in a full run); the medians differ from the means on purpose
TOKENS_PER_S = {
    "plain": [1000.0, 1000.0, 3000.0, 990.0, 1010.0],
    "shim": [970.0, 100.0, 975.0, 960.0, 2000.0],
    "emulated": [400.0, 410.0, 390.0, 5000.0, 405.0],
    "emulated+shim": [960.0, 950.0, 970.0, 10.0, 965.0],
    "plain+events": [990.0, 995.0, 2000.0, 985.0, 1000.0],
    "emulated+shim+events": [940.0, 930.0, 20.0, 950.0, 945.0],
}
#: host-bound tokens/s per round: the host's speed drifts between rounds (plain 100 -> 500), so only per-round
#: ratios compare like with like (the shim 0.99x plain in 3 rounds of 5, its median of medians 150 / 300 = 0.5x)
HOST_BOUND = {"plain": [100.0, 200.0, 300.0, 400.0, 500.0], _cc.FLOOR_SETUP: [95.0, 190.0, 285.0, 380.0, 475.0],
              "emulated": [50.0, 60.0, 70.0, 80.0, 90.0], "emulated+shim": [99.0, 150.0, 297.0, 396.0, 100.0],
              _cc.HELPER_SETUP: [96.0, 192.0, 288.0, 384.0, 480.0]}
READBACK_US = {"plain": 40.0, _cc.FLOOR_SETUP: 44.0, "emulated": 400.0, "emulated+shim": 52.0, _cc.HELPER_SETUP: 44.0}
GPU_PACED = {setup: [100.0, 200.0, 300.0] for setup in _cc.HOST_BOUND_SETUPS} | {
    _cc.FLOOR_SETUP: [93.0, 186.0, 279.0], "emulated": [80.0, 160.0, 240.0]}
GPU_PACED_LATE_SYNC_US = {setup: 90.0 if setup == "plain" else 1.0 for setup in _cc.HOST_BOUND_SETUPS}
LATE_SYNC_US = {"plain": 92.0, _cc.FLOOR_SETUP: 2.0, "emulated": 2.2, "emulated+shim": 4.0, _cc.HELPER_SETUP: 3.0}
# The host's time in d2h.wait_stream: an enqueue, but for the shim offloading in the GPU-paced loop (the job runs there)
WAIT_STREAM_US = {setup: 6.0 for setup in _cc.HOST_BOUND_SETUPS}
GPU_PACED_WAIT_STREAM_US = {setup: 80.0 if setup == "emulated+shim" else 6.5 for setup in _cc.HOST_BOUND_SETUPS}
RECORD_US = {"plain": 1.0, "shim, nothing pending": 1.5, "shim, a copy pending": 2.5}
H2D_US = {"plain": 50.0, "shim": 55.0, "emulated": 20_000.0, "emulated+shim": 100.0, _cc.TRANSFER_ALONE: 80.0,
          _cc.SHIM_IDLE: 96.0}


@pytest.fixture
def fake_gpu(monkeypatch):
    """Stand in for the GPU measurements; return the order in which setups were measured."""
    entered, measured = [], _Measured()
    rounds = {setup: iter(values) for setup, values in TOKENS_PER_S.items()}
    fake_torch = types.SimpleNamespace(device=lambda kind, index: f"{kind}:{index}",
                                       cuda=types.SimpleNamespace(set_device=lambda device: None))
    monkeypatch.setattr(_cc, "_require_gpu", lambda: fake_torch)
    monkeypatch.setattr(_cc, "_cycles_per_ms", lambda torch: 1_000_000)
    monkeypatch.setattr(_cc, "_Model", lambda torch, device, cycles: None)
    monkeypatch.setattr(cc, "new_d2h_stream", lambda device: None)
    monkeypatch.setattr(_cc, "_enter", entered.append)

    def decode_loop(torch, device, model, d2h, steps, warmup, events=False):
        setup = entered[-1] + (_cc.EVENTS if events else "")
        measured.append(setup)
        return next(rounds[setup])

    monkeypatch.setattr(_cc, "_decode_loop", decode_loop)
    def h2d_return_us(torch, device, cycles, repeats, queued_ms=20.0, then_wait=False):
        if queued_ms:
            assert not then_wait
            setup = entered[-1]
        else:  # the idle-GPU rows: the transfer alone (no syncless, the host waits), then the shim's path
            setup = {("plain", True): _cc.TRANSFER_ALONE, ("emulated+shim", False): _cc.SHIM_IDLE}[
                (entered[-1], then_wait)]
        h2d_measured.append(setup)
        # The median of the samples is the figure; one outlier per call must not move it.
        return [H2D_US[setup]] * (repeats - 1) + [H2D_US[setup] * 50]

    h2d_measured = []
    monkeypatch.setattr(_cc, "_h2d_return_us", h2d_return_us)
    monkeypatch.setattr(_cc, "_record_us", lambda torch, device, cycles, repeats: dict(RECORD_US))
    measured.h2d = h2d_measured
    monkeypatch.setattr(_cc, "_host_bound_rows", lambda torch, dev, quick, rounds, progress: (
        {_cc.HOST_BOUND_LOOP: dict(HOST_BOUND), _cc.GPU_PACED_LOOP: dict(GPU_PACED)}, dict(READBACK_US), 350.0,
        {_cc.HOST_BOUND_LOOP: dict(LATE_SYNC_US), _cc.GPU_PACED_LOOP: dict(GPU_PACED_LATE_SYNC_US)},
        {_cc.HOST_BOUND_LOOP: dict(WAIT_STREAM_US), _cc.GPU_PACED_LOOP: dict(GPU_PACED_WAIT_STREAM_US)}))
    return measured


class _Measured(list):
    h2d: list


def test_tables_and_goals_use_medians_against_the_right_setup(fake_gpu):
    output = _cc.run(argparse.Namespace(quick=False, out=None), lambda message: None)
    assert fake_gpu == list(_cc.LOOP_SETUPS) * 5  # interleaved: every round measures every setup
    # The H2D rounds interleave too: every row in turn, each round.
    assert fake_gpu.h2d == [*_cc.SETUPS, _cc.TRANSFER_ALONE, _cc.SHIM_IDLE] * _cc.H2D_ROUNDS

    median = {setup: statistics.median(values) for setup, values in TOKENS_PER_S.items()}
    assert median == {"plain": 1000.0, "shim": 970.0, "emulated": 405.0, "emulated+shim": 960.0,
                      "plain+events": 995.0, "emulated+shim+events": 940.0}
    (_, _, host_bound), (_, _, gpu_paced), (_, _, readback), (_, _, throughput), (_, _, h2d), (_, _, record) = (
        output.tables)
    # The GPU-paced loop's rows: the same columns, its own rates and waits (the shim 1.0x, beating the floor)
    assert gpu_paced[3] == ["emulated+shim", 200.0, 1.0, pytest.approx(1 / 0.93), 1.0, 80.0, 100.0, 300.0]
    assert gpu_paced[0][4] == 90.0 and output.data["gpu_paced_vs_plain"]["emulated+shim"] == pytest.approx(1.0)
    assert output.data["gpu_paced_vs_floor"][_cc.FLOOR_SETUP] == 1.0
    # setup, median tokens/s, vs plain and vs the floor (medians of per-round ratios), min, max
    assert [row[0] for row in host_bound] == list(_cc.HOST_BOUND_SETUPS)
    # ..., the host's median wait at the late synchronize, its median time in d2h.wait_stream, min, max
    assert host_bound[0] == ["plain", 300.0, 1.0, pytest.approx(1 / 0.95), 92.0, 6.0, 100.0, 500.0]
    assert host_bound[1] == [_cc.FLOOR_SETUP, 285.0, pytest.approx(0.95), 1.0, 2.0, 6.0, 95.0, 475.0]
    assert host_bound[3] == ["emulated+shim", 150.0, pytest.approx(0.99), pytest.approx(0.99 / 0.95), 4.0, 6.0, 99.0,
                             396.0]
    assert output.data["host_bound_late_sync_us"] == LATE_SYNC_US
    assert output.data["host_bound_wait_stream_us"] == WAIT_STREAM_US
    assert output.data["gpu_paced_wait_stream_us"] == GPU_PACED_WAIT_STREAM_US
    assert host_bound[4][:4] == [_cc.HELPER_SETUP, 288.0, pytest.approx(0.96), pytest.approx(0.96 / 0.95)]
    assert output.data["host_bound_vs_plain"]["emulated+shim"] == pytest.approx(0.99)
    assert readback == [["plain", 40.0, 1.0, pytest.approx(40 / 44)], [_cc.FLOOR_SETUP, 44.0, pytest.approx(1.1), 1.0],
                        ["emulated", 400.0, 10.0, pytest.approx(400 / 44)],
                        ["emulated+shim", 52.0, 1.3, pytest.approx(52 / 44)],
                        [_cc.HELPER_SETUP, 44.0, pytest.approx(1.1), 1.0]]
    assert throughput == [[setup, median[setup], pytest.approx(median[setup] / 1000.0), min(TOKENS_PER_S[setup]),
                           max(TOKENS_PER_S[setup])] for setup in _cc.LOOP_SETUPS]
    assert record == [[name, us, pytest.approx(us / 1.0)] for name, us in RECORD_US.items()]
    assert h2d == [[setup, H2D_US[setup], pytest.approx(H2D_US[setup] / 50.0), pytest.approx(H2D_US[setup] / 20_000),
                    pytest.approx(H2D_US[setup] / 80.0)] for setup in (*_cc.SETUPS, _cc.TRANSFER_ALONE, _cc.SHIM_IDLE)]
    assert output.data["median_tokens_per_s"] == median and output.data["h2d_return_us"] == H2D_US

    (host_goal, readback_goal, helper_host_goal, helper_readback_goal, with_shim, shim_alone, with_events, h2d_goal,
     h2d_vs_plain, h2d_vs_transfer) = output.goals
    # The same two with the D2H helper process (SYNCLESS_CC_D2H_HELPER=1): 0.96x plain in every round, 44 / 40 us.
    assert (helper_host_goal.measured, helper_host_goal.target) == (pytest.approx(0.96), 0.98)
    assert (helper_readback_goal.measured, helper_readback_goal.target) == (pytest.approx(1.1), 1.5)
    # Issue 33's host-bound goals: tokens/s with the shim under emulated CC vs plain, and one readback's host time.
    assert (host_goal.measured, host_goal.target, host_goal.higher_is_better) == (pytest.approx(0.99), 0.98, True)
    assert (readback_goal.measured, readback_goal.target) == (pytest.approx(1.3), 1.5)
    # The any-event rule's cost: the loop recording events, with the shim under emulated CC vs plain (940 / 995).
    assert (with_events.measured, with_events.target, with_events.higher_is_better) == (
        pytest.approx(940.0 / 995.0), 0.95, True)
    assert (with_shim.measured, with_shim.target, with_shim.higher_is_better) == (pytest.approx(0.96), 0.95, True)
    assert (shim_alone.measured, shim_alone.target, shim_alone.higher_is_better) == (pytest.approx(0.97), 0.98, True)
    assert (h2d_goal.measured, h2d_goal.target, h2d_goal.higher_is_better) == (pytest.approx(0.005), 0.02, False)
    # The shim's own cost: emulated CC with the shim against no CC at all, in the same run (100 / 50 us).
    assert (h2d_vs_plain.measured, h2d_vs_plain.target, h2d_vs_plain.higher_is_better) == (pytest.approx(2.0), 1.5,
                                                                                            False)
    assert "no CC" in h2d_vs_plain.description
    # The shim's own cost, like for like: its path against the least a host-synchronous copy costs, both on an
    # idle GPU (96 / 80 us).
    assert (h2d_vs_transfer.measured, h2d_vs_transfer.target) == (pytest.approx(1.2), 1.5)
    assert "transfer alone" in h2d_vs_transfer.description and "idle" in h2d_vs_transfer.description
    assert [g.met for g in output.goals] == [True, True, False, True, True, False, False, True, False, True]
    assert "emulated CC with the shim" in with_shim.description and "without CC" in shim_alone.description


def test_each_setup_turns_on_what_its_name_says(monkeypatch):
    calls = []
    monkeypatch.setattr(cc, "uninstall", lambda: calls.append("uninstall"))
    monkeypatch.setattr(cc, "install", lambda mode: calls.append(f"install({mode})"))
    monkeypatch.setattr(cc, "emulate", lambda: calls.append("emulate"))
    done = {}
    for setup in _cc.SETUPS:
        calls.clear()
        _cc._enter(setup)
        done[setup] = list(calls)
    assert done == {"plain": ["uninstall"], "shim": ["uninstall", "install(on)"], "emulated": ["uninstall", "emulate"],
                    "emulated+shim": ["uninstall", "install(emulate)"]}
    calls.clear()
    _cc._enter(_cc.FLOOR_SETUP)
    assert calls == ["uninstall"]  # the floor is plain torch (its loop adds the transfer's wait itself)

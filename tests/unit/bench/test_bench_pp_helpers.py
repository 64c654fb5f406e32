"""Plain helpers of the pp benchmark workers, exercised on the CPU."""

import math

import pytest
import torch

from syncless._core.errors import MissingDependencyError
from syncless.bench._pp_cuda import SPIN_KERNEL_NAME, SPIN_KERNEL_SOURCE, compile_cubin
from syncless.bench._pp_interfere import MAX_SENDS, send_count
from syncless.bench._pp_measure import gbps
from syncless.bench._pp_plan import HIDDEN
from syncless.bench._pp_rig import MAX_GATE_MS, GateTuner, make_payload, mean, median, pattern, poison, same_bits

CPU = torch.device("cpu")


def test_pattern_is_deterministic_spread_and_seed_dependent():
    a = pattern(1 << 16, 5, CPU)
    assert a.dtype == torch.int16 and a.shape == (1 << 16,)
    assert torch.equal(a, pattern(1 << 16, 5, CPU))
    assert not torch.equal(a, pattern(1 << 16, 6, CPU))
    assert len(torch.unique(a)) > 30_000  # close to random: most of the 65536 values differ
    assert int(a.min()) < -30_000 and int(a.max()) > 30_000
    assert (a == 0).float().mean() < 0.01  # not zeros


def test_pattern_prefix_does_not_depend_on_length():
    assert torch.equal(pattern(1000, 3, CPU), pattern(5000, 3, CPU)[:1000])


def test_payload_tensors_differ_and_compare_bit_for_bit():
    payload = make_payload(4, 11, CPU)
    assert set(payload) == {"hidden", "residual"}
    for tensor in payload.values():
        assert tensor.dtype == torch.bfloat16 and tensor.shape == (4, HIDDEN) and tensor.is_contiguous()
    assert not torch.equal(payload["hidden"].view(torch.int16), payload["residual"].view(torch.int16))
    again = make_payload(4, 11, CPU)
    assert same_bits(again, payload)  # NaN bit patterns included: compared as integers
    again["residual"].view(torch.int16)[2, 7] += 1
    assert not same_bits(again, payload)
    assert not same_bits(make_payload(3, 11, CPU), payload)  # wrong row count


def test_poison_sets_every_bit():
    payload = make_payload(2, 1, CPU)
    poison(payload)
    for tensor in payload.values():
        assert bool((tensor.view(torch.int16) == -1).all())


def test_gate_tuner_doubles_up_to_its_cap():
    tuner = GateTuner(10.0, growth=3.5)
    tuner.update(True)
    assert tuner.ms == 10.0
    tuner.update(False)
    assert tuner.ms == 20.0
    tuner.update(False)
    assert tuner.ms == 35.0
    tuner.update(False)
    assert tuner.ms == 35.0
    assert GateTuner(1500.0, growth=4.0).max_ms == MAX_GATE_MS
    assert GateTuner(5000.0).ms == MAX_GATE_MS


def test_gbps_and_send_count():
    assert gbps(1 << 30, 10, 1000.0) == pytest.approx(10 * (1 << 30) / 1e9)
    assert math.isnan(gbps(1, 0, 1.0)) and math.isnan(gbps(1, 5, 0.0)) and math.isnan(gbps(1, 5, float("nan")))
    # 64 MiB at ~335 GB/s is ~0.2 ms a step: a 62 ms window needs ~400 sends with the 1.3 margin
    count = send_count(62.0, 64 << 20, 335.0)
    assert 380 < count < 420
    assert send_count(62.0, 64 << 20, float("nan")) > count  # unknown rate: assume the fastest link, send more
    assert send_count(1e9, 1 << 16, 400.0) == MAX_SENDS


def test_mean_and_median_of_nothing_are_nan():
    assert math.isnan(mean([])) and math.isnan(median([]))
    assert median([3.0, 1.0, 2.0]) == 2.0 and mean([1.0, 2.0]) == 1.5


def test_spin_kernel_compiles_or_says_nvrtc_is_missing():
    # NVRTC needs no GPU: where its library is present this compiles for real.
    try:
        cubin = compile_cubin(SPIN_KERNEL_SOURCE, SPIN_KERNEL_NAME, "sm_90")
    except MissingDependencyError as err:
        assert "NVRTC" in str(err) and "pip install" in str(err)
    else:
        assert cubin[:4] == b"\x7fELF"
        assert SPIN_KERNEL_NAME.encode() in cubin


def test_compile_errors_carry_the_log():
    try:
        compile_cubin("this is not CUDA", "broken", "sm_90")
    except MissingDependencyError:
        pytest.skip("NVRTC is not installed here")
    except RuntimeError as err:
        assert "NVRTC could not compile broken for sm_90" in str(err)
    else:
        pytest.fail("compiling garbage did not fail")

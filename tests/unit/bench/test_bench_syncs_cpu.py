"""`syncless bench syncs` on the CPU: goals read from its own tables; the region wraps only the wrapped op."""

import argparse
import contextlib
import time

import pytest
import torch

from syncless import syncs
from syncless.bench import _syncs


def test_goals_and_derived_columns_follow_the_measurements(tmp_path):
    mode_before, enabled_before = syncs.mode(), syncs.is_enabled()
    lines = []
    output = _syncs.run(argparse.Namespace(quick=True, out=None), lines.append)
    assert (syncs.mode(), syncs.is_enabled()) == (mode_before, enabled_before)  # the detector is left as found
    on_gpu = torch.cuda.is_available()  # a CUDA machine measures the real thing, with the same columns
    assert lines and lines[0].startswith("measuring on GPU (" if on_gpu else "measuring on CPU only")

    (bare_name, bare, one), (off_name, off, off_ratio) = output.data["allowed"]
    assert (bare_name, one) == ("with nullcontext()", 1.0) and "allowed()" in off_name
    assert off_ratio == pytest.approx(off / bare)
    region = output.data["region"]
    assert [row[0] for row in region] == ["with nullcontext()", "with checking()", "plain call", "@checked call"]
    assert region[1][2] == pytest.approx(region[1][1] - region[0][1])
    assert region[3][2] == pytest.approx(region[3][1] - region[2][1])
    copies = output.data["copies"]
    assert [row[0] for row in copies] == ["Tensor.copy_", "Tensor.to"]
    for _, original_ns, wrapped_ns, added_us, _, _ in copies:
        assert added_us == pytest.approx((wrapped_ns - original_ns) / 1000)  # ns -> us

    allowed_goal, copy_goal = output.goals[:2]  # a GPU with cupti-python adds the CUPTI layer's goal
    assert allowed_goal.measured == off_ratio and allowed_goal.target == 1.5 and allowed_goal.unit == "x"
    assert copy_goal.measured == max(row[3] for row in copies) and copy_goal.target == 0.5 and copy_goal.unit == "us"
    assert not allowed_goal.higher_is_better and not copy_goal.higher_is_better

    output.plot(tmp_path / "syncs.png")
    assert (tmp_path / "syncs.png").read_bytes()[:4] == b"\x89PNG"


def test_interleaved_timing_puts_only_the_wrapped_op_in_the_region():
    state = {"inside": False}
    seen = {"original": set(), "wrapped": set()}

    @contextlib.contextmanager
    def region():
        state["inside"] = True
        try:
            yield
        finally:
            state["inside"] = False

    def original():
        seen["original"].add(state["inside"])

    def wrapped():
        seen["wrapped"].add(state["inside"])
        time.sleep(20e-6)  # makes the wrapped op measurably slower, so the two results cannot be swapped

    original_ns, wrapped_ns = _syncs._interleaved_copy_ns(torch, False, original, wrapped, batches=2, in_region=region)
    assert seen == {"original": {False}, "wrapped": {True}}
    assert 0 < original_ns < 20_000 <= wrapped_ns

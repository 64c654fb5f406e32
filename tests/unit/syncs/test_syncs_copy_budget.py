"""What a wrapped ``Tensor.to``/``copy_`` costs outside a checked region, counted in Python calls.

Outside a region the detector has nothing to check; the patch entry then
calls the layer beneath it (torch's method) directly: one Python call (the
entry) and one ContextVar read. The count is written in docs/syncs.md.
"""

from __future__ import annotations

import sys

import pytest
import torch

from syncless import syncs
from syncless._core import patching


def _calls(fn):
    """(Python calls, C calls) that ``fn()`` makes, counted with sys.setprofile."""
    counts = {"call": 0, "c_call": 0}

    def profile(frame, event, arg):
        if event in counts:
            counts[event] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts["call"], counts["c_call"] - 1  # the c_call of sys.setprofile(None) itself


@pytest.mark.parametrize("form", ["copy_", "to"])
def test_a_wrapped_copy_outside_a_region_costs_one_python_call(form, fake_mode):
    src, dst = torch.randn(64), torch.empty(64)
    call = (lambda: dst.copy_(src)) if form == "copy_" else (lambda: src.to(torch.float64))
    call()
    python, c = _calls(call)
    assert (python, c) == (2, 2), f"{form}: {python} Python calls (the lambda and the entry), {c} C calls"
    with syncs.checking():
        assert _calls(call)[0] > 2  # inside a region the wrapper reads the call


def test_the_bypass_goes_to_the_layer_beneath_not_around_it(restored_globals):
    class Owner:
        @staticmethod
        def plain(x):
            return x

    Owner.method = lambda self, x: ("base", x)
    seen = []
    busy = [0]

    def low(beneath):
        def wrapper(*args, **kwargs):
            seen.append("low")
            return beneath(*args, **kwargs)

        return wrapper

    def top(beneath):
        def wrapper(*args, **kwargs):
            seen.append("top")
            return beneath(*args, **kwargs)

        return wrapper

    patching.add_layer(Owner, "method", "low", 10, low)
    patching.add_layer(Owner, "method", "top", 30, top, idle=lambda: busy[0])
    try:
        assert Owner().method(1) == ("base", 1) and seen == ["low"]  # idle: top skipped, low still runs
        busy[0] = 1
        seen.clear()
        assert Owner().method(2) == ("base", 2) and seen == ["top", "low"]
        patching.remove_layer(Owner, "method", "top")
        busy[0] = 0
        seen.clear()
        assert Owner().method(3) == ("base", 3) and seen == ["low"]
    finally:
        patching.remove_layer(Owner, "method", "top")
        patching.remove_layer(Owner, "method", "low")

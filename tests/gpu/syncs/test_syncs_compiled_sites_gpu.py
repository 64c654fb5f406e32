"""On a real GPU: a sync inside a compiled graph is reported at the user's call, not at generated code.

Whether a compiled graph synchronizes is inductor's choice (torch 2.11 keeps ``x * x.sum().item()`` on the
device: no copy, no wait), so each case first measures it: with a long kernel queued, a call that waits for
the GPU returns after the kernel. The report must agree with that measurement, site for site, and at least
the data-dependent cases must really wait, so that the test cannot pass on a graph that never syncs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from syncless import syncs

HERE = Path(__file__).name
BUSY_CYCLES = 100_000_000  # tens of milliseconds on an H200


def _scale(x):
    return x * x.sum().item()


def _scale_and_tell(x):
    scalar = x.sum().item()
    return x * scalar, scalar


def _positives(x):
    return torch.nonzero(x > 0)


CASES = {
    "item kept on the device or not": (_scale, False),
    "item returned to Python": (_scale_and_tell, True),
    "nonzero (data-dependent shape)": (_positives, True),
}


def _waits_for_the_gpu(fn, x) -> bool:
    """Whether ``fn(x)`` returns only after a long kernel queued before it (measured, outside any region)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(BUSY_CYCLES)
    torch.cuda.synchronize()
    busy_s = time.perf_counter() - start
    torch.cuda._sleep(BUSY_CYCLES)
    start = time.perf_counter()
    fn(x)
    call_s = time.perf_counter() - start
    torch.cuda.synchronize()
    return call_s > busy_s / 2


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_a_sync_inside_a_compiled_graph_is_one_site_at_the_callers_line(detector, cuda_device, monkeypatch, case):
    fn, must_wait = CASES[case]
    # capture_scalar_outputs keeps .item() in the graph and capture_dynamic_output_shape_ops keeps nonzero:
    # inductor's generated wrapper (torchinductor_*/...py) runs them, and torch's debug mode warns from there.
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)
    monkeypatch.setattr(torch._dynamo.config, "capture_dynamic_output_shape_ops", True)
    syncs.set_mode("record")
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    sizes = (16, 32, 48)
    try:
        for size in sizes:  # compiled before the region: compiling synchronizes by design
            compiled(torch.randn(size, device=cuda_device))
        waits = _waits_for_the_gpu(compiled, torch.randn(sizes[0], device=cuda_device))
        assert waits or not must_wait, f"{case}: the compiled call did not wait for the GPU"
        syncs.reset()
        inputs = [torch.randn(size, device=cuda_device) for size in sizes]
        with syncs.checking():
            for x in inputs:
                line = sys._getframe().f_lineno + 1
                compiled(x)
    finally:
        torch._dynamo.reset()
    found = syncs.report()
    where = [(Path(s.first.filename).name, s.first.lineno) for s in found.sites]
    told = f"{case}: the call {'waits' if waits else 'does not wait'} for the GPU\n{found.format()}"
    if not waits:
        assert where == [], told
        return
    assert where == [(HERE, line)], told
    # One site, seen at every call (a call may sync more than once: nonzero reads its count, then copies).
    count = found.sites[0].count
    assert count >= len(sizes) and count % len(sizes) == 0, told

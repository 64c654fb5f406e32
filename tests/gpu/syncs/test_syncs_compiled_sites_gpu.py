"""On a real GPU: a sync inside a compiled graph is reported at the user's call, not at generated code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from syncless import syncs

HERE = Path(__file__).name


@pytest.mark.gpu
def test_an_item_inside_a_compiled_graph_is_one_site_at_the_callers_line(detector, cuda_device, monkeypatch):
    # capture_scalar_outputs keeps .item() in the graph: inductor's generated wrapper
    # (torchinductor_*/...py) calls it, and torch's debug mode warns from that file's line.
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)
    syncs.set_mode("record")

    def scale(x):
        return x * x.sum().item()

    torch._dynamo.reset()
    compiled = torch.compile(scale, fullgraph=True, dynamic=False)
    sizes = (16, 32, 48)
    try:
        for size in sizes:  # compiled before the region: compiling synchronizes by design
            compiled(torch.randn(size, device=cuda_device))
        inputs = [torch.randn(size, device=cuda_device) for size in sizes]
        with syncs.checking():
            for x in inputs:
                line = sys._getframe().f_lineno + 1
                out = compiled(x)
                assert out.shape == x.shape
    finally:
        torch._dynamo.reset()
    found = syncs.report()
    rows = [(Path(s.first.filename).name, s.first.lineno, s.count) for s in found.sites]
    assert rows == [(HERE, line, len(sizes))], found.format()

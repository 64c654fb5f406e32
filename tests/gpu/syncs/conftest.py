"""GPU fixtures for the detector: real torch debug mode, state restored after each test."""

from __future__ import annotations

import types
import warnings

import pytest

from support.detector import detector_put_back
from syncless import syncs
from syncless.syncs import _hook


@pytest.fixture
def detector(cuda_device):
    """The detector enabled in ``error`` mode on the real GPU; everything put back after."""
    import torch

    originals = [(torch.Tensor, "to"), (torch.Tensor, "cuda"), (torch.Tensor, "copy_"), (torch.cuda, "synchronize"),
                 (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in originals]
    with detector_put_back():
        syncs.set_mode("error")
        syncs.reset()
        assert syncs.enable(), "the detector must be active on a GPU machine"
        yield
    for owner, name, original in originals:
        assert getattr(owner, name) is original
    assert warnings.showwarning is not _hook.showwarning


@pytest.fixture
def data(cuda_device):
    """Fresh random tensors on the GPU, in pinned and in pageable memory (made before any check)."""
    import torch

    rows, cols = 64, 32
    d = types.SimpleNamespace(dev=cuda_device)
    d.g = torch.randn(rows, cols, device=cuda_device)
    d.g2 = d.g + torch.rand(rows, cols, device=cuda_device)
    d.gi = torch.randint(0, 100, (rows,), device=cuda_device)
    d.idx = torch.randint(0, rows, (8,), device=cuda_device)
    d.idx2 = torch.randint(0, cols, (rows, 4), device=cuda_device)
    d.g_out = torch.full((rows, cols), float("nan"), device=cuda_device)
    d.g_out_half = torch.full((rows, cols), float("nan"), device=cuda_device, dtype=torch.float16)
    d.g_half_cols = torch.full((rows, cols // 2), float("nan"), device=cuda_device)
    d.g_t_out = torch.full((cols, rows), float("nan"), device=cuda_device)
    d.g_empty = torch.empty(0, cols, device=cuda_device)
    d.pinned = torch.randn(rows, cols).pin_memory()
    d.pinned_row = torch.randn(1, cols).pin_memory()
    d.pinned_out = torch.full((rows, cols), float("nan")).pin_memory()
    d.pageable = torch.randn(rows, cols)
    d.pageable_out = torch.full((rows, cols), float("nan"))
    d.pageable_empty = torch.empty(0, cols)
    d.event = torch.cuda.Event()
    d.event.record()
    # A CUDA graph captured up front; replaying it never touches the host.
    d.graph_in = torch.randn(rows, cols, device=cuda_device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        d.graph_out = d.graph_in * 2 + 1  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    d.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(d.graph):
        d.graph_out = d.graph_in * 2 + 1
    torch.cuda.synchronize()
    return d

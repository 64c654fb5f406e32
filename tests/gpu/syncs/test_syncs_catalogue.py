"""Catalogues on a real GPU: ops that synchronize are caught at the user's line, others never.

Each operation is a one-line lambda, so the line the detector must name is
the lambda's first line. The explicit ops are those torch's sync debug mode
reports (a blocking ``cudaMemcpy`` + stream sync inside ``.item()``,
``nonzero`` and blocking copies: ``memcpy_and_sync``); the host waits and
the implicit copies are the detector's own wrappers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from syncless import syncs
from syncless.syncs import SyncViolation

HERE = Path(__file__).name

SYNCING = {
    # explicit: torch's debug mode reports these
    "item": lambda d: d.g.sum().item(),
    "tolist": lambda d: d.g[:4].tolist(),
    "bool": lambda d: bool(d.g.sum() > 0),
    "int": lambda d: int(d.gi.sum()),
    "float": lambda d: float(d.g.max()),
    "nonzero": lambda d: torch.nonzero(d.g > 0),
    "nonzero_as_tuple": lambda d: (d.g > 0).nonzero(as_tuple=True),
    "boolean_mask_index": lambda d: d.g[d.g > 0],
    "where_one_argument": lambda d: torch.where(d.g > 0),
    "argwhere": lambda d: torch.argwhere(d.g),
    "cpu": lambda d: d.g.cpu(),
    "to_cpu_blocking": lambda d: d.g.to("cpu"),
    "cuda_blocking_pageable": lambda d: d.pageable.cuda(),
    "to_cuda_blocking_pinned": lambda d: d.pinned.to(d.dev),
    "copy_d2h_blocking": lambda d: d.pinned_out.copy_(d.g),
    "copy_h2d_blocking": lambda d: d.g_out.copy_(d.pageable),
    "unique": lambda d: torch.unique(d.gi),
    "allclose": lambda d: torch.allclose(d.g, d.g2),
    "masked_select": lambda d: torch.masked_select(d.g, d.g > 0),
    # host waits: the detector's wrappers
    "cuda_synchronize": lambda d: torch.cuda.synchronize(),
    "stream_synchronize": lambda d: torch.cuda.current_stream().synchronize(),
    "event_synchronize": lambda d: d.event.synchronize(),
    # implicit: non_blocking copies that block anyway (the detector's wrappers)
    "pageable_h2d_to": lambda d: d.pageable.to(d.dev, non_blocking=True),
    "pageable_h2d_cuda": lambda d: d.pageable.cuda(non_blocking=True),
    "pageable_h2d_copy": lambda d: d.g_out.copy_(d.pageable, non_blocking=True),
    "strided_pinned_h2d_to": lambda d: d.pinned[:, ::2].to(d.dev, non_blocking=True),
    "strided_pinned_h2d_copy": lambda d: d.g_half_cols.copy_(d.pinned[:, ::2], non_blocking=True),
    "strided_pinned_d2h_copy": lambda d: d.pinned_out[:, ::2].copy_(d.g[:, ::2], non_blocking=True),
    "pageable_d2h_copy": lambda d: d.pageable_out.copy_(d.g, non_blocking=True),
    "transposed_pinned_into_contiguous": lambda d: d.g_t_out.copy_(d.pinned.t(), non_blocking=True),
    "broadcast_pinned_row": lambda d: d.g_out.copy_(d.pinned_row, non_blocking=True),
    "converting_transposed_pinned_to": lambda d: d.pinned.t().to(d.dev, dtype=torch.float16, non_blocking=True),
}
if hasattr(getattr(torch, "accelerator", None), "synchronize"):
    SYNCING["accelerator_synchronize"] = lambda d: torch.accelerator.synchronize()

NOT_SYNCING = {
    "pinned_h2d_to": lambda d: d.pinned.to(d.dev, non_blocking=True),
    "pinned_h2d_cuda": lambda d: d.pinned.cuda(non_blocking=True),
    "pinned_h2d_copy": lambda d: d.g_out.copy_(d.pinned, non_blocking=True),
    "pinned_d2h_copy": lambda d: d.pinned_out.copy_(d.g, non_blocking=True),
    "d2h_to_cpu_non_blocking": lambda d: d.g.to("cpu", non_blocking=True),
    "strided_d2h_to_cpu_non_blocking": lambda d: d.g[:, ::2].to("cpu", non_blocking=True),
    "converting_pinned_h2d_to": lambda d: d.pinned.to(d.dev, dtype=torch.float16, non_blocking=True),
    "converting_pinned_h2d_copy": lambda d: d.g_out_half.copy_(d.pinned, non_blocking=True),
    "transposed_pinned_h2d_to": lambda d: d.pinned.t().to(d.dev, non_blocking=True),
    "transposed_pinned_into_transposed": lambda d: d.g_out.t().copy_(d.pinned.t(), non_blocking=True),
    "transposed_d2h_into_transposed_pinned": lambda d: d.pinned_out.t().copy_(d.g.t(), non_blocking=True),
    "empty_pageable_h2d": lambda d: d.pageable_empty.to(d.dev, non_blocking=True),
    "empty_d2h_copy_into_pageable": lambda d: d.pageable_empty.copy_(d.g_empty, non_blocking=True),
    "d2d_copy": lambda d: d.g_out.copy_(d.g, non_blocking=True),
    "d2d_convert": lambda d: d.g.to(torch.float16),
    "matmul": lambda d: d.g @ d.g.t(),
    "softmax": lambda d: torch.softmax(d.g, dim=-1),
    "sum_on_gpu": lambda d: d.g.sum(),
    "where_three_arguments": lambda d: torch.where(d.g > 0, d.g, 0.0),
    "masked_fill": lambda d: d.g.masked_fill(d.g > 0, 0.0),
    "argmax_on_gpu": lambda d: torch.argmax(d.g),
    "cumsum": lambda d: torch.cumsum(d.g, 0),
    "index_select": lambda d: d.g.index_select(0, d.idx),
    "gather": lambda d: torch.gather(d.g, 1, d.idx2),
    "transpose_contiguous": lambda d: d.g.t().contiguous(),
    "cat": lambda d: torch.cat([d.g, d.g2]),
    "randn_on_gpu": lambda d: torch.randn(16, device=d.dev),
    "cuda_graph_replay": lambda d: d.graph.replay(),
    "event_query": lambda d: d.event.query(),
    "stream_wait_event": lambda d: torch.cuda.current_stream().wait_event(d.event),
}


def test_catalogues_are_large_enough():
    assert len(SYNCING) >= 25 and len(NOT_SYNCING) >= 25


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SYNCING))
def test_syncing_op_raises_at_its_line(name, detector, data):
    op = SYNCING[name]
    line = op.__code__.co_firstlineno
    with pytest.raises(SyncViolation) as caught:
        with syncs.checking():
            op(data)
    message = str(caught.value)
    assert f"{HERE}:{line}" in message, message
    assert "Fix:" in message
    assert torch.cuda.get_sync_debug_mode() == 0  # disarmed after the region


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SYNCING))
def test_syncing_op_is_fine_outside_a_region_and_when_allowed(name, detector, data):
    op = SYNCING[name]
    op(data)
    with syncs.checking(), syncs.allowed():
        op(data)
    assert not syncs.report()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(NOT_SYNCING))
def test_non_syncing_op_is_never_reported(name, detector, data):
    op = NOT_SYNCING[name]
    with syncs.checking():
        op(data)
        op(data)
    assert not syncs.report(), syncs.report().format()


@pytest.mark.gpu
def test_copies_that_were_not_reported_moved_the_right_bytes(detector, data):
    with syncs.checking():
        up = data.pinned.t().to(data.dev, non_blocking=True)
        down = data.g.to("cpu", non_blocking=True)
        data.pinned_out.t().copy_(data.g.t(), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()  # outside the region
    assert torch.equal(up.cpu(), data.pinned.t())
    assert torch.equal(down, data.g.cpu())
    assert torch.equal(data.pinned_out, data.g.cpu())
    assert up.stride() == data.pinned.t().stride()

"""The torch-level catalogue with the CUPTI backend: each syncing op once, at its line; the others silent.

The ops are those of ``test_syncs_catalogue.py`` (so the line to name is in
that file). With CUPTI the copy and wait behind each torch-level sync is
seen too, and must merge into the same row, not add one: an ``.item()`` is
one sync, seen by torch and CUPTI, with the host time it blocked.
"""

from __future__ import annotations

import pytest
import torch

from syncless import syncs

from .cupti_fixtures import cupti_detector, rows_at  # noqa: F401 - the fixture is used by name
from .test_syncs_catalogue import NOT_SYNCING, SYNCING

CATALOGUE = "test_syncs_catalogue.py"
# Ops whose sync is a torch-level host wait with no copy behind it: CUPTI must see that wait.
WAITS = {"cuda_synchronize", "stream_synchronize", "event_synchronize", "accelerator_synchronize"}


def _record(backend: str, op, data):
    """Run ``op`` once in a checked region with ``backend``; return the report."""
    syncs.disable()
    syncs.reset()
    syncs.set_backend(backend)
    assert syncs.enable()
    torch.cuda._sleep(1_000_000)  # keep the GPU busy, so that a wait really waits
    with syncs.checking():
        op(data)
    found = syncs.report()
    syncs.reset()
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SYNCING))
def test_syncing_op_is_one_row_at_its_line(name, cupti_detector, data):  # noqa: F811
    op = SYNCING[name]
    line = op.__code__.co_firstlineno
    op(data)  # first use outside the region
    oracle = _record("torch", op, data)  # torch's layers alone: how many syncs this op is
    found = _record("cupti", op, data)
    rows = rows_at(found, CATALOGUE, line)
    assert len(found.sites) == 1 and len(rows) == 1, found.format()
    (row,) = rows
    assert row.count == oracle.total >= 1, f"torch backend:\n{oracle.format()}\ncupti backend:\n{found.format()}"
    print(f"{name}: seen by {'+'.join(row.layers)}, CUDA calls {row.api_calls}, blocked {row.blocked_total_ns / 1000:.1f} us")
    assert row.layers[0] in ("torch", "wrapper"), row.layers
    if name in WAITS:
        assert "cupti" in row.layers and row.timed_count == 1, found.format()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(NOT_SYNCING))
def test_non_syncing_op_is_silent_with_cupti(name, cupti_detector, data):  # noqa: F811
    op = NOT_SYNCING[name]
    op(data)  # first use outside the region (cuBLAS handles, lazy module loading)
    torch.cuda.synchronize()
    with syncs.checking():
        op(data)
        op(data)
    assert not syncs.report(), syncs.report().format()

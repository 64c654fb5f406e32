"""On a real GPU: regions and allows written inside compiled code hold at its graph breaks.

The sync is a real one (``.item()`` of a CUDA tensor, seen by torch's own
debug mode), made in a function dynamo does not trace, so that it runs at a
graph break. Each form runs on the eager, aot_eager and inductor backends,
and the forms without a graph break compile with ``fullgraph=True`` (also
``mode="reduce-overhead"``) with no recompile when the gate flips.
"""

from __future__ import annotations

import pytest
import torch

from syncless import syncs
from syncless._core.errors import SyncViolation

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

BACKENDS = ("eager", "aot_eager", "inductor")
CALLS = 3


@dynamo.disable
def sync_at_break(y):
    return y.sum().item()  # a real device-to-host wait, run eagerly at a graph break


def checked_body(x):
    y = torch.sin(x) * 2
    sync_at_break(y)
    return y + 1


def checking_inside(x):
    y = torch.sin(x) * 2
    with syncs.checking():
        sync_at_break(y)
        y = y - 1
    return y + 1


def allowed_inside(x):
    y = torch.sin(x) * 2
    with syncs.allowed():
        sync_at_break(y)
    return y + 1


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from nothing, and its dynamo counters start at zero."""
    for clear in (dynamo.reset, counters.clear):
        clear()
    yield
    dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["compile(checked(fn))", "checking() inside", "checked fn called from compiled code"])
def test_a_sync_at_a_graph_break_is_checked(form, backend, detector, fresh_dynamo, cuda_device):
    syncs.set_mode("record")  # the detector fixture enabled it in error mode
    syncs.reset()
    if form == "compile(checked(fn))":
        step = torch.compile(syncs.checked(checked_body), backend=backend)
    elif form == "checking() inside":
        step = torch.compile(checking_inside, backend=backend)
    else:
        inner = syncs.checked(checked_body)
        step = torch.compile(lambda x: inner(torch.cos(x)) - 1, backend=backend)
    for _ in range(CALLS):
        step(torch.randn(1024, device=cuda_device))
    found = syncs.report()
    assert found.total == CALLS and len(found.sites) == 1, found.format()
    assert found.sites[0].first.filename == __file__, found.format()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_allowed_inside_compiled_code_covers_a_sync_at_a_graph_break(backend, detector, fresh_dynamo, cuda_device):
    step = torch.compile(allowed_inside, backend=backend)  # the detector is in error mode
    with syncs.checking():
        for _ in range(CALLS):
            step(torch.randn(1024, device=cuda_device))
        with pytest.raises(SyncViolation):
            sync_at_break(torch.randn(4, device=cuda_device))  # the control: outside the allow region


def _fullgraph_step(x):
    with syncs.checking(), syncs.allowed(first_only=True):
        x = torch.sin(x) * 2
    return x + 1


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"backend": "inductor"}, {"backend": "inductor", "mode": "reduce-overhead"},
                                     {"backend": "aot_eager"}], ids=["inductor", "reduce-overhead", "aot_eager"])
def test_every_form_compiles_fullgraph_and_the_gate_never_recompiles(options, detector, fresh_dynamo, cuda_device):
    inner = syncs.checked(_fullgraph_step)
    step = torch.compile(lambda x: inner(x) * 3, fullgraph=True, **options)
    x = torch.randn(1024, device=cuda_device)
    want = (_fullgraph_step(x) * 3).cpu()
    syncs.disable()
    torch.testing.assert_close(step(x).cpu(), want)  # compiled before enable(); inductor may differ in the last bits
    frames = dict(counters["frames"])
    for _ in range(2):
        assert syncs.enable()
        with syncs.checking():
            out = step(x)
        syncs.disable()
        torch.testing.assert_close(out.cpu(), want)
    assert dict(counters["frames"]) == frames, f"recompiled when the gate flipped: {dict(counters['frames'])}"

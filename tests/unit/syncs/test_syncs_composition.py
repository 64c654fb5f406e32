"""syncs and cc both layered over torch, with another library patching ``Tensor.to``/``copy_`` too.

The other library patches after one or both of ours; every install order and
every uninstall order keeps its patch working, keeps it in place after we
leave, and keeps ours working beneath it while we are there.
"""

from __future__ import annotations

import pytest
import torch

import syncless.cc as cc
from syncless import syncs
from syncless._core import patching
from syncless._core.errors import SyncViolation
from syncless.syncs import _copies, _debugmode
from syncless.syncs._copies import TensorFacts


@pytest.fixture(autouse=True)
def _pretend_cuda_is_available(monkeypatch):
    """cc.install() patches nothing on a torch without CUDA; these tests are about the patch layers."""
    monkeypatch.setattr(cc, "_cuda_available", lambda: True)

NAMES = ("to", "copy_")


class ForeignTensorPatch:
    """Another library: wraps ``Tensor.to`` and ``Tensor.copy_`` over whatever is there, counting calls."""

    def __init__(self) -> None:
        self.calls = {name: 0 for name in NAMES}
        self.saved = {name: torch.Tensor.__dict__.get(name) for name in NAMES}
        self.patched = {}
        for name in NAMES:
            below = getattr(torch.Tensor, name)

            def patched(*args, _below=below, _name=name, **kwargs):
                self.calls[_name] += 1
                return _below(*args, **kwargs)

            self.patched[name] = patched
            setattr(torch.Tensor, name, patched)

    def undo(self) -> None:
        for name, saved in self.saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


def _exercise(foreign: ForeignTensorPatch) -> None:
    """Ordinary calls give torch's results and pass through the other library's patch."""
    before = dict(foreign.calls)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    dst = torch.full((3, 4), float("nan"))
    half = x.to(torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, x.half())
    assert dst.copy_(other=y, non_blocking=True) is dst and torch.equal(dst, y)
    assert foreign.calls == {name: before[name] + 1 for name in NAMES}


def _syncs_sees_calls(expect: bool) -> None:
    """In error mode, a pageable non_blocking H2D through ``copy_`` raises before torch runs, if syncs is there."""
    gpu = TensorFacts(True, False, False, (3, 4), (4, 1), torch.float32)
    if not expect:
        assert not patching.is_layered(torch.Tensor, "copy_", _copies.LAYER_KEY)
        return
    with pytest.raises(SyncViolation), syncs.checking():
        torch.Tensor.copy_(gpu, torch.randn(3, 4), non_blocking=True)


@pytest.fixture
def syncs_in_error_mode(restored_globals, monkeypatch):
    plain = _copies._plain_tensor_types()
    monkeypatch.setattr(_copies, "_plain_tensor_types", lambda: (*plain, TensorFacts))
    with _debugmode.fake():
        syncs.set_mode("error")
        yield
        syncs.disable()
        cc.uninstall()


def _install(which: str) -> None:
    if which == "syncs":
        assert syncs.enable()
    else:
        assert cc.install("emulate")


def _uninstall(which: str) -> None:
    if which == "syncs":
        syncs.disable()
    else:
        cc.uninstall()


@pytest.mark.parametrize("first", ["syncs", "cc"])
@pytest.mark.parametrize("first_out", ["syncs", "cc"])
@pytest.mark.parametrize("foreign_at", ["between", "after"])
def test_syncs_cc_and_a_foreign_patch_in_every_order(first, first_out, foreign_at, syncs_in_error_mode):
    originals = {name: torch.Tensor.__dict__.get(name) for name in NAMES}
    second = "cc" if first == "syncs" else "syncs"
    _install(first)
    foreign = ForeignTensorPatch() if foreign_at == "between" else None
    _install(second)
    foreign = foreign or ForeignTensorPatch()
    _exercise(foreign)
    _syncs_sees_calls(True)
    assert patching.is_layered(torch.Tensor, "to", "cc.shim")

    _uninstall(first_out)
    _exercise(foreign)
    _syncs_sees_calls(first_out != "syncs")
    assert patching.is_layered(torch.Tensor, "to", "cc.shim") == (first_out != "cc")

    _uninstall("cc" if first_out == "syncs" else "syncs")
    assert {name: torch.Tensor.__dict__[name] for name in NAMES} == foreign.patched  # its patch stays
    _exercise(foreign)
    _syncs_sees_calls(False)
    assert not patching.is_layered(torch.Tensor, "to")

    foreign.undo()  # it puts back what it found: a syncless entry, now a pass-through
    _exercise_plain()
    # The next syncless layer starts from torch's own method; when it leaves, torch's attribute is back as it was.
    _install("syncs")
    _uninstall("syncs")
    assert {name: torch.Tensor.__dict__.get(name) for name in NAMES} == originals


def _exercise_plain() -> None:
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    dst = torch.full((3, 4), float("nan"))
    assert torch.equal(x.to(torch.float64), x.double())
    assert dst.copy_(other=y) is dst and torch.equal(dst, y)

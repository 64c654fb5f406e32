"""The checks the ``Tensor.to`` / ``.cuda`` / ``.copy_`` wrappers run, on a CPU build.

A violating copy raises from the wrapper before torch touches CUDA, so the
error mode's SyncViolation shows the check ran. CUDA tensors and pinned CPU
tensors are described with TensorFacts, which the checks are told to treat
like a plain tensor (on a real GPU they would be real tensors).
"""

from __future__ import annotations

import pytest
import torch

from support.fresh_python import imports_module
from syncless import syncs
from syncless._core.errors import SyncViolation
from syncless.syncs import _copies, _report
from syncless.syncs._copies import PAGEABLE_D2H, PAGEABLE_H2D, REASONS, STRIDED_H2D, TensorFacts

SHAPE = (2, 3, 4, 5)
CHANNELS_LAST = (60, 1, 15, 3)  # torch.empty(SHAPE).to(memory_format=torch.channels_last).stride()


def on_gpu(shape=SHAPE) -> TensorFacts:
    """A dense CUDA tensor."""
    return TensorFacts(True, False, False, shape, _copies.contiguous_strides(shape), torch.float32)


def pinned_channels_last() -> TensorFacts:
    """A pinned CPU tensor laid out channels-last (dense, not contiguous)."""
    return TensorFacts(False, True, True, SHAPE, CHANNELS_LAST, torch.float32)


@pytest.fixture
def error_mode(fake_mode, monkeypatch):
    """The detector in error mode, with TensorFacts passing as a plain tensor."""
    syncs.set_mode("error")
    plain = _copies._plain_tensor_types()
    monkeypatch.setattr(_copies, "_plain_tensor_types", lambda: (*plain, TensorFacts))
    return fake_mode


def violation_of(call) -> _report.Violation:
    """Run ``call`` in a checked region; return the SyncViolation's violation."""
    with pytest.raises(SyncViolation) as info, syncs.checking():
        call()
    assert info.value.violation.filename == __file__  # located at the user's call
    return info.value.violation


def assert_no_report(check, self, args, kwargs):
    """Run a wrapper's check directly in a checked region: it must neither raise nor record."""
    with syncs.checking():
        check(self, args, kwargs)
    assert not syncs.report()


# ---- Tensor.to ------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda t: t.to("cuda", non_blocking=True),
    lambda t: t.to("cuda", torch.float16, True),  # non_blocking given positionally
    lambda t: t.to(device="cuda", non_blocking=True, memory_format=torch.contiguous_format),
], ids=["keyword", "positional", "memory_format"])
def test_to_cuda_from_pageable_raises_before_torch(error_mode, call):
    pageable = torch.randn(4, 8)
    found = violation_of(lambda: call(pageable))
    assert found.operation == f"Tensor.to(cuda) with non_blocking=True {REASONS[PAGEABLE_H2D]}"
    assert syncs.report().total == 1  # recorded as well as raised


def test_to_another_device_is_not_a_cuda_copy(error_mode):
    # Only CPU <-> CUDA copies can be implicit syncs; meta is neither.
    with syncs.checking():
        assert torch.randn(4, 8).to("meta", non_blocking=True).is_meta
    assert not syncs.report()


def test_to_honours_memory_format(error_mode):
    # A pinned channels-last source used as is, unless a contiguous result is asked for.
    src = pinned_channels_last()
    assert_no_report(_copies._check_to, src, ("cuda",), {"non_blocking": True})
    found = violation_of(lambda: torch.Tensor.to(src, "cuda", non_blocking=True, memory_format=torch.contiguous_format))
    assert found.operation == f"Tensor.to(cuda) with non_blocking=True {REASONS[STRIDED_H2D]}"


def test_to_with_preserve_format_is_like_no_memory_format(error_mode):
    kwargs = {"non_blocking": True, "memory_format": torch.preserve_format}
    assert_no_report(_copies._check_to, pinned_channels_last(), ("cuda",), kwargs)


def test_to_cpu_from_gpu_is_pinned_and_not_reported(error_mode):
    assert_no_report(_copies._check_to, on_gpu(), ("cpu",), {"non_blocking": True})


# ---- Tensor.cuda ----------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda t: t.cuda(non_blocking=True),
    lambda t: t.cuda(None, True),  # non_blocking is cuda()'s second parameter
    lambda t: t.cuda(non_blocking=True, memory_format=torch.channels_last),
], ids=["keyword", "positional", "memory_format"])
def test_cuda_from_pageable_raises_before_torch(error_mode, call):
    found = violation_of(lambda: call(torch.randn(2, 3, 4, 5)))
    assert found.operation == f"Tensor.cuda() with non_blocking=True {REASONS[PAGEABLE_H2D]}"


def test_cuda_reads_non_blocking_from_its_own_position(error_mode):
    # cuda(device, non_blocking): a device given first is not non_blocking.
    assert_no_report(_copies._check_cuda, torch.randn(4, 8), ("cuda", False), {})
    assert_no_report(_copies._check_cuda, torch.randn(4, 8), (0,), {})


def test_cuda_honours_memory_format(error_mode):
    src = pinned_channels_last()
    assert_no_report(_copies._check_cuda, src, (), {"non_blocking": True})
    found = violation_of(lambda: torch.Tensor.cuda(src, non_blocking=True, memory_format=torch.contiguous_format))
    assert found.operation == f"Tensor.cuda() with non_blocking=True {REASONS[STRIDED_H2D]}"


# ---- Tensor.copy_ ---------------------------------------------------------

@pytest.mark.parametrize("positional", [False, True])
def test_copy_into_gpu_from_pageable_is_h2d(error_mode, positional):
    gpu, pageable = on_gpu((4, 8)), torch.randn(4, 8)
    if positional:
        found = violation_of(lambda: torch.Tensor.copy_(gpu, pageable, True))
    else:
        found = violation_of(lambda: torch.Tensor.copy_(gpu, pageable, non_blocking=True))
    assert found.operation == f"Tensor.copy_ (H2D) with non_blocking=True {REASONS[PAGEABLE_H2D]}"


def test_copy_into_pageable_from_gpu_is_d2h(error_mode):
    pageable = torch.randn(4, 8)
    found = violation_of(lambda: pageable.copy_(on_gpu((4, 8)), non_blocking=True))
    assert found.operation == f"Tensor.copy_ (D2H) with non_blocking=True {REASONS[PAGEABLE_D2H]}"


def test_copy_check_reads_keyword_arguments(error_mode):
    gpu, pageable = on_gpu((4, 8)), torch.randn(4, 8)
    with pytest.raises(SyncViolation), syncs.checking():
        _copies._check_copy(gpu, (), {"other": pageable, "non_blocking": True})  # torch names it other
    syncs.reset()
    assert_no_report(_copies._check_copy, gpu, (pageable,), {})  # blocking by default


def test_blocking_copy_is_not_reported(error_mode):
    pageable = torch.randn(4, 8)
    dst = torch.empty(4, 8).fill_(float("nan"))
    with syncs.checking():
        assert dst.copy_(pageable, non_blocking=False) is dst
    assert torch.equal(dst, pageable) and not syncs.report()


# ---- where nothing is reported ------------------------------------------------

def test_checks_report_nothing_outside_a_checked_region(error_mode):
    pageable = torch.randn(4, 8)
    _copies._check_to(pageable, ("cuda",), {"non_blocking": True})
    _copies._check_cuda(pageable, (), {"non_blocking": True})
    _copies._check_copy(on_gpu((4, 8)), (pageable, True), {})
    with syncs.checking(), syncs.allowed():
        _copies._check_to(pageable, ("cuda",), {"non_blocking": True})
    assert not syncs.report()


def test_checks_step_aside_for_fake_tensors(error_mode):
    # torch.compile traces with fake tensors: their copies are not the user's.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4, 8)
    assert not fake.is_pinned()
    assert_no_report(_copies._check_to, fake, ("cuda",), {"non_blocking": True})
    assert_no_report(_copies._check_cuda, fake, (), {"non_blocking": True})
    assert_no_report(_copies._check_copy, on_gpu((4, 8)), (fake, True), {})


def test_checks_step_aside_while_compiling(error_mode, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert_no_report(_copies._check_to, torch.randn(4, 8), ("cuda",), {"non_blocking": True})


def test_the_copy_check_does_not_import_sympy():
    # torch.broadcast_shapes imports sympy on its first call: seconds of host time inside the first non_blocking
    # copy_ of a checked region, spent by the detector itself (the cc shim measured it on an H200).
    code = (
        "import torch\n"
        "from syncless.syncs._copies import _check_copy\n"
        "_check_copy(torch.empty(4, 3), (torch.empty(3),), {'non_blocking': True})\n"
    )
    assert imports_module(code, "sympy") is False

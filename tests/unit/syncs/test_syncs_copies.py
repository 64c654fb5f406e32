"""Classification of non_blocking copies: the one function the wrappers call.

CPU tensors are real (pageable here); pinned CPU tensors and CUDA tensors
are described with TensorFacts, which carries what a tensor would report.
"""

from __future__ import annotations

import random

import pytest
import torch

from syncless.syncs import _copies
from syncless.syncs._copies import (
    PAGEABLE_D2H,
    PAGEABLE_H2D,
    STRIDED_D2H,
    STRIDED_H2D,
    TensorFacts,
    classify_copy,
    planned_to_result,
)


def facts(t: torch.Tensor, *, cuda: bool = False, pinned: bool = False, dtype=None) -> TensorFacts:
    """Describe ``t``'s layout as if it lived on the GPU or in pinned memory."""
    return TensorFacts(cuda, not cuda, pinned, tuple(t.shape), tuple(t.stride()), t.dtype if dtype is None else dtype)


def base(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def test_uses_the_wrappers_function():
    assert _copies._check_copy.__globals__["classify_copy"] is classify_copy
    assert _copies._check_to.__globals__["classify_copy"] is classify_copy


# ---- host to device -------------------------------------------------------

def test_pageable_source_blocks_even_when_dense():
    src = base(8, 16)  # a real pageable CPU tensor
    assert not src.is_pinned()
    assert classify_copy(facts(src, cuda=True), src, True) == PAGEABLE_H2D


def test_blocking_copies_are_torchs_business():
    src = base(8, 16)
    assert classify_copy(facts(src, cuda=True), src, False) is None


def test_pinned_dense_source_is_asynchronous():
    src = base(8, 16)
    assert classify_copy(facts(src, cuda=True), facts(src, pinned=True), True) is None


def test_pinned_transposed_source_through_to_keeps_its_layout():
    src = base(8, 16).t()
    result = planned_to_result(facts(src, pinned=True), True, None, None, True)
    assert result.strides == tuple(src.stride())
    assert classify_copy(result, facts(src, pinned=True), True) is None


def test_pinned_transposed_source_into_contiguous_target_is_staged():
    src = base(8, 16).t()
    dst = torch.empty(16, 8)
    assert classify_copy(facts(dst, cuda=True), facts(src, pinned=True), True) == STRIDED_H2D


@pytest.mark.parametrize("view", ["step", "narrow", "column"])
def test_pinned_strided_slice_is_staged(view):
    whole = base(8, 16)
    src = {"step": whole[:, ::2], "narrow": whole[:, :5], "column": whole[:, 3]}[view]
    result = planned_to_result(facts(src, pinned=True), True, None, None, True)
    assert result.strides == tuple(torch.empty(src.shape).stride())  # the result is contiguous
    assert classify_copy(result, facts(src, pinned=True), True) == STRIDED_H2D


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_preserve_format_plans_like_no_memory_format(layout):
    whole = base(8, 16)
    src = {"transposed": whole.t(), "strided": whole[:, ::2]}[layout]
    plain = planned_to_result(facts(src, pinned=True), True, None, None, True)
    preserved = planned_to_result(facts(src, pinned=True), True, None, torch.preserve_format, True)
    assert preserved == plain


def test_dtype_conversion_of_a_pinned_dense_source_is_asynchronous():
    src = base(8, 16)
    result = planned_to_result(facts(src, pinned=True), True, torch.float16, None, True)
    assert classify_copy(result, facts(src, pinned=True), True) is None


def test_dtype_conversion_of_a_pinned_transposed_source_is_staged():
    src = base(8, 16).t()
    result = planned_to_result(facts(src, pinned=True), True, torch.float16, None, True)
    assert classify_copy(result, facts(src, pinned=True), True) == STRIDED_H2D


def test_broadcast_pinned_row_is_staged():
    row = base(1, 16)
    dst = torch.empty(8, 16)
    assert classify_copy(facts(dst, cuda=True), facts(row, pinned=True), True) == STRIDED_H2D


def test_empty_and_single_element_copies():
    empty = base(0, 16)
    assert classify_copy(facts(empty, cuda=True), empty, True) is None  # even pageable: nothing moves
    one = base(4, 4)[1:2, 2:3]
    assert classify_copy(facts(torch.empty(1, 1), cuda=True), facts(one, pinned=True), True) is None


def test_single_element_pageable_copies_still_block():
    # Only an empty copy is exempt: one element from or into pageable memory still syncs.
    one = base(1)
    assert classify_copy(facts(one, cuda=True), one, True) == PAGEABLE_H2D
    assert classify_copy(one, facts(one, cuda=True), True) == PAGEABLE_D2H


# ---- device to host -------------------------------------------------------

def test_pageable_destination_blocks():
    dst = base(8, 16)
    assert classify_copy(dst, facts(dst, cuda=True), True) == PAGEABLE_D2H


def test_pinned_dense_destination_is_asynchronous():
    dst = base(8, 16)
    assert classify_copy(facts(dst, pinned=True), facts(dst, cuda=True), True) is None
    converting = facts(dst, cuda=True, dtype=torch.bfloat16)
    assert classify_copy(facts(dst, pinned=True), converting, True) is None


def test_pinned_strided_destination_is_staged():
    whole = base(8, 16)
    dst = whole[:, ::2]
    src = torch.empty(dst.shape)
    assert classify_copy(facts(dst, pinned=True), facts(src, cuda=True), True) == STRIDED_D2H


def test_pinned_transposed_destination_with_the_same_layout_is_asynchronous():
    dst = base(8, 16).t()
    assert classify_copy(facts(dst, pinned=True), facts(dst, cuda=True), True) is None
    contiguous_src = torch.empty(dst.shape)
    assert classify_copy(facts(dst, pinned=True), facts(contiguous_src, cuda=True), True) == STRIDED_D2H


def test_dtype_conversion_into_a_transposed_pinned_destination_is_staged():
    # Same layout but another dtype: torch converts through a contiguous pageable temporary.
    dst = base(8, 16).t()
    converting = facts(dst, cuda=True, dtype=torch.float16)
    assert classify_copy(facts(dst, pinned=True), converting, True) == STRIDED_D2H


@pytest.mark.parametrize("layout", ["dense", "transposed", "strided"])
def test_to_cpu_non_blocking_gets_a_pinned_result(layout):
    whole = base(8, 16)
    src = {"dense": whole, "transposed": whole.t(), "strided": whole[:, ::3]}[layout]
    gpu = facts(src, cuda=True)
    result = planned_to_result(gpu, False, None, None, True)
    assert result.pinned
    assert classify_copy(result, gpu, True) is None


def test_cpu_only_and_gpu_only_copies_are_not_considered():
    t = base(4, 4)
    assert classify_copy(t, t.t(), True) is None
    assert classify_copy(facts(t, cuda=True), facts(t.t(), cuda=True), True) is None


# ---- the layout predicates match torch's own ---------------------------------

def _random_view(rng: random.Random) -> torch.Tensor:
    shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
    t = torch.randn(*shape)
    t = t.permute(*rng.sample(range(t.dim()), t.dim()))
    for dim in range(t.dim()):
        if rng.random() < 0.3 and t.shape[dim] > 1:
            t = t.narrow(dim, rng.randint(0, 1), t.shape[dim] - 1)
        if rng.random() < 0.2:
            t = t[(slice(None),) * dim + (slice(None, None, 2),)]
    if rng.random() < 0.2:
        t = t.unsqueeze(0).expand(2, *t.shape)  # a broadcast dim: stride 0, overlapping
    return t


def test_layout_predicates_agree_with_torch():
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    for _ in range(300):
        t = _random_view(rng)
        shape, stride = tuple(t.shape), tuple(t.stride())
        assert _copies.is_contiguous_layout(shape, stride) == t.is_contiguous(), (shape, stride)
        # empty_like keeps the strides exactly when the tensor is non-overlapping and dense
        kept = all(n == 1 or a == b for n, a, b in zip(shape, stride, torch.empty_like(t).stride()))
        assert _copies.is_dense_layout(shape, stride) == kept, (shape, stride)


def test_check_to_accepts_copy_true_like_torch():
    # Inside a checked region the wrapper parses Tensor.to's arguments; copy= is valid there too.
    t = base(4, 4)
    _copies._check_to(t, ("cpu",), {"non_blocking": True, "copy": True})  # CPU -> CPU: nothing to report
    _copies._check_to(t, (torch.float16,), {"copy": True})  # cannot be non_blocking: not even parsed

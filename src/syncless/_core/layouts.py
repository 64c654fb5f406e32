"""Plain-Python facts about strided tensor layouts (shapes and strides in elements)."""

from __future__ import annotations

from collections.abc import Sequence


def is_dense_layout(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's ``is_non_overlapping_and_dense``: some permutation of the dims is contiguous.

    Empty tensors count as dense; dims of size 1 are ignored.
    """
    if any(size == 0 for size in shape):
        return True
    dims = sorted((stride, size) for size, stride in zip(shape, strides) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def broadcasts_to(src_shape: Sequence[int], dst_shape: Sequence[int]) -> bool:
    """Whether a tensor of ``src_shape`` broadcasts to exactly ``dst_shape`` (what ``dst.copy_(src)`` accepts).

    Plain Python on the shapes: ``torch.broadcast_shapes`` imports sympy on its first call (seconds, measured
    on an H200 machine), which would block the host inside the first ``non_blocking`` copy that asks.
    """
    if len(src_shape) > len(dst_shape):
        return False
    trailing = dst_shape[len(dst_shape) - len(src_shape):]
    return all(s == d or s == 1 for s, d in zip(src_shape, trailing))


def same_dense_layout(shape_a: Sequence[int], strides_a: Sequence[int], shape_b: Sequence[int],
                      strides_b: Sequence[int]) -> bool:
    """Whether two tensors have one shape and one dense layout (strides equal wherever a dim's size is not 1).

    Such a pair is copied by torch as one block of memory, as it lies (``copy_`` with equal dtypes needs no
    temporary then), even when neither tensor is contiguous (two transposes, for example).
    """
    if tuple(shape_a) != tuple(shape_b):
        return False
    if any(size != 1 and sa != sb for size, sa, sb in zip(shape_a, strides_a, strides_b)):
        return False
    return is_dense_layout(shape_a, strides_a)

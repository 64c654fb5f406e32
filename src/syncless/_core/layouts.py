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

"""A CUDA tensor as the shim's fast lane (``syncless.cc._fast``) reads it, for CPU tests of the lane's choices."""

from __future__ import annotations


class LaneBlock:
    """One contiguous 64-byte block of 8 int64 on GPU 0: every attribute and method ``_fast._offload`` reads."""

    layout = "strided"
    is_nested = is_quantized = requires_grad = False
    nbytes = 64
    dtype = "int64"
    shape = (8,)

    def get_device(self):
        return 0

    def stride(self):
        return (1,)

    def is_contiguous(self):
        return True

    def is_conj(self):
        return False

    def is_neg(self):
        return False

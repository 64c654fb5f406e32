"""The shim's own broadcast check agrees with torch's copy_, and needs no sympy."""

from __future__ import annotations

import random

import torch

from support.fresh_python import imports_module
from syncless._core.layouts import broadcasts_to


def test_fills_agrees_with_torch_copy_on_random_shapes():
    rng = random.Random(20261130)
    for _ in range(400):
        dst = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 3)))
        src = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 4)))
        try:
            torch.empty(dst).copy_(torch.zeros(src))
            torch_accepts = True
        except RuntimeError:
            torch_accepts = False
        assert broadcasts_to(src, dst) == torch_accepts, (src, dst)


def test_the_check_does_not_import_sympy():
    # torch.broadcast_shapes imports sympy on first use (seconds inside the first non_blocking copy).
    code = (
        "import torch\n"
        "from syncless.cc._shim import _check_broadcastable\n"
        "_check_broadcastable(torch.empty(4, 3), torch.empty(3))\n"
    )
    assert imports_module(code, "sympy") is False

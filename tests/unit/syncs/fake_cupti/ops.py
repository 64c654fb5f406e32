"""A torch operator whose CPU kernel makes a blocking CUDA call (through the stand-in), for compiled graphs.

It lives in the stand-in's package, so its frames are plumbing like a C++
kernel's: the user's frame is found outside the compiled graph that calls it.
"""

from __future__ import annotations

import torch

from . import call

_library = None


def register() -> None:
    """Define ``syncless_fake::blocking_clone`` (idempotent): a clone that calls cuStreamSynchronize."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("syncless_fake", "DEF")
    library.define("blocking_clone(Tensor x) -> Tensor")
    library.impl("blocking_clone", _blocking_clone, "CPU")
    library.impl("blocking_clone", _shape_only, "Meta")
    _library = library


def _blocking_clone(x):
    call("cuStreamSynchronize", [0])
    return x.clone()


def _shape_only(x):
    return torch.empty_like(x)

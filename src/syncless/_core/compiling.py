"""Whether ``torch.compile`` is tracing the calling code right now."""

from __future__ import annotations


def is_compiling() -> bool:
    """Return True while dynamo traces the caller (it folds this call to a constant there).

    Wrappers call it first and step aside when it is True, so that a compiled graph
    holds the plain torch call instead of our Python bookkeeping. Imports torch, so
    call it only where torch is already loaded.
    """
    import torch

    return bool(torch.compiler.is_compiling())

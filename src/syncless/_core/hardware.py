"""How many GPUs this process can use, and what a test needing some should do.

``torch.cuda`` is touched only when a function here is called, never at import.
"""

from __future__ import annotations

from typing import Literal

GateAction = Literal["run", "skip", "fail"]


def cuda_device_count() -> int:
    """Return the number of CUDA GPUs torch can use (0 on a CPU-only build)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def gpu_gate(needed: int, available: int, required: bool) -> tuple[GateAction, str]:
    """Decide whether a test that needs ``needed`` GPUs runs, skips or fails.

    Args:
        needed: GPUs the test needs (0 for a CPU test).
        available: GPUs present.
        required: ``SYNCLESS_REQUIRE_GPU`` is set, so a missing GPU is a failure
            (a GPU run must not pass by skipping).
    """
    if available >= needed:
        return "run", ""
    reason = f"needs {needed} CUDA GPU(s), found {available}"
    if required:
        return "fail", f"{reason}, and SYNCLESS_REQUIRE_GPU=1 forbids skipping"
    return "skip", reason

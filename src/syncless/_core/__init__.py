"""Shared foundations: errors, the ``SYNCLESS_*`` registry, lazy CUDA access, logging.

Capability packages import from here and never from each other.
"""

from syncless._core.errors import (
    ConfigError,
    CopyEngineUnavailable,
    CudaError,
    MissingDependencyError,
    PeerTimeoutError,
    SynclessError,
    SyncViolation,
)

__all__ = [
    "ConfigError",
    "CopyEngineUnavailable",
    "CudaError",
    "MissingDependencyError",
    "PeerTimeoutError",
    "SyncViolation",
    "SynclessError",
]

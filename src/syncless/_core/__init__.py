"""Shared foundations: errors, the ``SYNCLESS_*`` registry, lazy CUDA access, logging.

The error hierarchy is listed here once; ``syncless/__init__.py`` re-exports
it from here. Importing this package imports neither torch nor any CUDA library.

Capability packages import from here and never from each other.
"""

from syncless._core.errors import (
    ConfigError,
    CopyEngineUnavailable,
    CudaError,
    MissingDependencyError,
    NoGPUError,
    PeerTimeoutError,
    SynclessError,
    SyncViolation,
    TransportClosedError,
    TransportError,
    TransportFailedError,
    TransportSetupError,
)

__all__ = [
    "ConfigError",
    "CopyEngineUnavailable",
    "CudaError",
    "MissingDependencyError",
    "NoGPUError",
    "PeerTimeoutError",
    "SyncViolation",
    "SynclessError",
    "TransportClosedError",
    "TransportError",
    "TransportFailedError",
    "TransportSetupError",
]

"""Pipeline-parallel stage transport: activations on the GPUs' copy engines, or torch.distributed.

    transport = make_transport(pp_group, persistent)   # collective over the group
    transport.send({"hidden": h, "residual": r})       # stage i
    out = transport.recv()                             # stage i+1: views of `persistent`
    step = transport.recv(wait=False)                  # or: the GPU wait queued at first use (docs/pp.md)
    transport.backend, transport.fallback_reason
    transport.error, transport.abort(), transport.leaked_nbytes   # failure model: docs/pp.md

Importing this package touches no CUDA API.
"""

from syncless._core.errors import (
    CopyEngineUnavailable,
    PeerTimeoutError,
    TransportClosedError,
    TransportError,
    TransportFailedError,
    TransportSetupError,
)
from syncless.pp._base import Transport
from syncless.pp._eligibility import describe_local_choice
from syncless.pp._layout import TensorSpec
from syncless.pp._make import make_transport
from syncless.pp._persistent import alloc_persistent
from syncless.pp._received import ReceivedStep

__all__ = [
    "CopyEngineUnavailable",
    "PeerTimeoutError",
    "ReceivedStep",
    "TensorSpec",
    "Transport",
    "TransportClosedError",
    "TransportError",
    "TransportFailedError",
    "TransportSetupError",
    "alloc_persistent",
    "describe_local_choice",
    "make_transport",
]

"""syncless: keep GPU inference pipelines asynchronous.

Three capabilities live in sub-packages, each imported on demand:

* :mod:`syncless.syncs` finds hidden GPU<->CPU synchronizations in hot code.
* :mod:`syncless.cc` keeps ``non_blocking`` copies non-blocking under NVIDIA
  Confidential Computing.
* :mod:`syncless.pp` moves pipeline-parallel activations on copy engines.

Importing this package touches no CUDA API. It warns (once, through the
``syncless`` logger) about any ``SYNCLESS_*`` variable that is not a
setting, such as a misspelt one: see ``docs/configuration.md``.
"""

from syncless._core.config import warn_unknown_names as _warn_unknown_names
from syncless._core.errors import CudaError, SynclessError

__version__ = "0.1.0"

__all__ = ["CudaError", "SynclessError", "__version__"]

_warn_unknown_names()

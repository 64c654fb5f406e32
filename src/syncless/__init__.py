"""syncless: keep GPU inference pipelines asynchronous.

Three capabilities live in sub-packages, each imported on demand:

* :mod:`syncless.syncs` finds hidden GPU<->CPU synchronizations in hot code.
* :mod:`syncless.cc` keeps ``non_blocking`` copies non-blocking under NVIDIA
  Confidential Computing.
* :mod:`syncless.pp` moves pipeline-parallel activations on copy engines.

Importing this package touches no CUDA API.
"""

from syncless._core.errors import CudaError, SynclessError

__version__ = "0.1.0"

__all__ = ["CudaError", "SynclessError", "__version__"]

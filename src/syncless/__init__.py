"""syncless: keep GPU inference pipelines asynchronous.

Three capabilities live in sub-packages, each imported on demand:

* :mod:`syncless.syncs` finds hidden GPU<->CPU synchronizations in hot code.
* :mod:`syncless.cc` keeps ``non_blocking`` copies non-blocking under NVIDIA
  Confidential Computing.
* :mod:`syncless.pp` moves pipeline-parallel activations on copy engines.

This package itself holds the version and the one error hierarchy that every
capability raises from (``syncless._core.errors``), so that
``except syncless.TransportError`` works without importing a capability.
Names that belong to one capability (``syncs.SyncWarning``,
``syncs.SyncCheckConfigWarning``, ``cc.D2HCopyError``, ...) stay in it: their
packages import torch, and this one imports neither torch nor any CUDA
library.

Importing it warns (once, through the ``syncless`` logger) about any
``SYNCLESS_*`` variable that is not a setting, such as a misspelt one: see
``docs/configuration.md``.
"""

from syncless._core import *  # noqa: F403 - the error hierarchy, listed once in _core/__init__.py
from syncless._core import __all__ as _core_names
from syncless._core.config import warn_unknown_names as _warn_unknown_names

__version__ = "0.1.0"

__all__ = [*_core_names, "__version__"]

_warn_unknown_names()

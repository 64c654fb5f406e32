"""Lazy access to the CUDA driver (cuda-bindings) and to NVML (nvidia-ml-py).

This is the only module that imports ``cuda.bindings`` or ``pynvml``; it does
so on first use, so that importing syncless needs neither a GPU, a driver nor
those packages. Missing pieces raise :class:`MissingDependencyError` with the
command that fixes them; failing driver calls raise :class:`CudaError` with
the driver's own error name.
"""

from __future__ import annotations

import functools
import threading
from types import ModuleType
from typing import Any

from syncless._core.errors import CudaError, MissingDependencyError

CUDA_EXTRA_HINT = "install it with `pip install 'syncless[cuda]'` (cuda-bindings and nvidia-ml-py)"
DRIVER_HINT = "install the NVIDIA driver, or run on a machine with an NVIDIA GPU"

_init_lock = threading.Lock()
_initialized = False


def import_optional(package: str, name: str, distribution: str, hint: str) -> ModuleType:
    """Return what ``from package import name`` gives (``name`` empty: ``import package``).

    Raises:
        MissingDependencyError: it cannot be imported; the message names
            ``distribution`` (what pip installs) and ``hint`` (the command).
    """
    try:
        module = __import__(package, fromlist=[name] if name else [])
    except ImportError as err:
        raise MissingDependencyError(f"{distribution} is not installed: {hint}") from err
    if not name:
        return module
    if not hasattr(module, name):  # __import__ passes over a missing submodule named in fromlist
        raise MissingDependencyError(f"{distribution} is not installed ({package}.{name} is missing): {hint}")
    return getattr(module, name)


@functools.cache
def driver_module() -> ModuleType:
    """Return ``cuda.bindings.driver``, importing it on first use.

    Raises:
        MissingDependencyError: cuda-bindings is not installed.
    """
    return import_optional("cuda.bindings", "driver", "cuda-bindings", CUDA_EXTRA_HINT)


def _error_text(drv: ModuleType, code: Any) -> tuple[str, str]:
    name = getattr(code, "name", None) or str(code)
    try:
        text_err, text = drv.cuGetErrorString(code)
    except RuntimeError:  # cuda.pathfinder: the driver library itself is missing
        return name, "no description (the CUDA driver library is not loaded)"
    text_str = text.decode() if text_err == drv.CUresult.CUDA_SUCCESS and text else "no description"
    return name, text_str


def check(call: str, result: Any, hint: str = "") -> Any:
    """Unpack a cuda-bindings result tuple, raising :class:`CudaError` on failure.

    cuda-bindings returns ``(CUresult, value...)``. This returns ``None`` for
    no value, the value for one, and a tuple for several.
    """
    drv = driver_module()
    if isinstance(result, tuple):
        code, values = result[0], result[1:]
    else:
        code, values = result, ()
    if code != drv.CUresult.CUDA_SUCCESS:
        name, text = _error_text(drv, code)
        raise CudaError(call, int(code), name, text, hint)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def call(name: str, *args: Any, hint: str = "") -> Any:
    """Call driver function ``name`` with ``args`` and :func:`check` its result."""
    drv = ensure_driver()
    return check(name, getattr(drv, name)(*args), hint)


def ensure_driver() -> ModuleType:
    """Import cuda-bindings and initialize the driver once; return the module.

    Blocks the host only for ``cuInit`` on first call.

    Raises:
        MissingDependencyError: cuda-bindings or the driver library is missing,
            or no GPU is present.
    """
    global _initialized
    drv = driver_module()
    if _initialized:
        return drv
    with _init_lock:
        if _initialized:
            return drv
        try:
            result = drv.cuInit(0)
        except RuntimeError as err:  # cuda.pathfinder: libcuda.so not found
            raise MissingDependencyError(f"the CUDA driver library (libcuda) was not found: {DRIVER_HINT}") from err
        code = result[0] if isinstance(result, tuple) else result
        if code == drv.CUresult.CUDA_ERROR_NO_DEVICE:
            raise MissingDependencyError(f"the CUDA driver sees no GPU: {DRIVER_HINT}")
        check("cuInit", result, DRIVER_HINT)
        _initialized = True
    return drv


def driver_version() -> tuple[int, int]:
    """Return the driver's CUDA version as ``(major, minor)``."""
    version = call("cuDriverGetVersion")
    return version // 1000, (version % 1000) // 10


def device_attribute(ordinal: int, attribute_name: str) -> int:
    """Return ``CU_DEVICE_ATTRIBUTE_<attribute_name>`` of GPU ``ordinal``."""
    drv = ensure_driver()
    device = call("cuDeviceGet", ordinal)
    attribute = getattr(drv.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attribute_name}")
    return int(call("cuDeviceGetAttribute", attribute, device))


def supports_64bit_stream_mem_ops(ordinal: int) -> bool:
    """Return whether GPU ``ordinal`` can wait on and write 64-bit flags from a stream."""
    return device_attribute(ordinal, "CAN_USE_64_BIT_STREAM_MEM_OPS") == 1


def can_access_peer(ordinal: int, peer_ordinal: int) -> bool:
    """Return whether GPU ``ordinal`` can map memory of GPU ``peer_ordinal``."""
    ensure_driver()
    device = call("cuDeviceGet", ordinal)
    peer = call("cuDeviceGet", peer_ordinal)
    return bool(call("cuDeviceCanAccessPeer", device, peer))


# NVML ----------------------------------------------------------------------

_nvml_lock = threading.Lock()
_nvml_ready = False


@functools.cache
def nvml_module() -> ModuleType:
    """Return ``pynvml`` (from nvidia-ml-py), importing it on first use."""
    return import_optional("pynvml", "", "nvidia-ml-py", CUDA_EXTRA_HINT)


def nvml_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "NVML cannot answer": NVML missing, or an NVML error.

    For ``except`` clauses that must not swallow unrelated errors.
    """
    try:
        return (MissingDependencyError, nvml_module().NVMLError)
    except MissingDependencyError:
        return (MissingDependencyError,)


def ensure_nvml() -> ModuleType:
    """Import and initialize NVML once; return ``pynvml``.

    Raises:
        MissingDependencyError: nvidia-ml-py or the NVML library is missing.
    """
    global _nvml_ready
    nvml = nvml_module()
    if _nvml_ready:
        return nvml
    with _nvml_lock:
        if not _nvml_ready:
            try:
                nvml.nvmlInit()
            except nvml.NVMLError_LibraryNotFound as err:
                raise MissingDependencyError(f"the NVML library (libnvidia-ml) was not found: {DRIVER_HINT}") from err
            except nvml.NVMLError_DriverNotLoaded as err:
                raise MissingDependencyError(f"the NVIDIA driver is not loaded: {DRIVER_HINT}") from err
            _nvml_ready = True
    return nvml

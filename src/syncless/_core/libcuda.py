"""The CUDA driver through ``ctypes``, for hot paths: about a microsecond of host time per call.

cuda-bindings' wrappers cost 2-4 us per call (argument objects, result
enums, tuples). On the CC shim's per-copy paths that was most of the cost:
the raw device copy of an offloaded readback took 8.2 us for two calls
(issue 33, run 31). Here each call is one ``ctypes`` foreign call on plain
integers (device pointers, stream and event handles as ``int``), and its
``CUresult`` is an ``int``: 0 is success; anything else raises
:class:`~syncless._core.errors.CudaError`, named by the driver.

Two handles on the same library:

- ``QUICK`` (``ctypes.PyDLL``): the GIL stays held through the call. For
  calls that only enqueue or read state (record an event, a device copy, a
  kernel launch, a query, the current context). Releasing the GIL for a
  microsecond would invite another Python thread in, and taking it back
  then costs a switch (issue 33: each take of the GIL by a helper thread
  while the loop runs Python).
- ``BLOCKING`` (``ctypes.CDLL``): the GIL is released for the call. For the
  calls that wait (``cuEventSynchronize``, ``cuStreamSynchronize``) and for
  a host<->device copy, which under CC returns only once it is done.

cuda-bindings stays the binding for everything else (setup, streams,
modules): it initializes the driver (``cuInit``) before this module is
used, and this module loads the same ``libcuda``.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from syncless._core.errors import CudaError, MissingDependencyError

_lock = threading.Lock()
_LIBS: list[Any] = [None]  # (quick, blocking) once loaded
LOADED = _LIBS  # the same list, for hot paths that read it before calling libraries() (one call fewer)
LOADED_FROM: list[str] = [""]  # the name or path libcuda was opened by (the D2H helper process opens the same)

_u64 = ctypes.c_uint64
_ptr = ctypes.c_void_p
_size = ctypes.c_size_t
_uint = ctypes.c_uint
_int = ctypes.c_int

# name -> (argument types): every function returns a CUresult (int)
_SIGNATURES = {
    "cuCtxGetCurrent": (ctypes.POINTER(_ptr),),
    "cuMemcpyDtoDAsync_v2": (_u64, _u64, _size, _ptr),
    "cuMemcpyDtoHAsync_v2": (_ptr, _u64, _size, _ptr),
    "cuEventRecord": (_ptr, _ptr),
    "cuEventQuery": (_ptr,),
    "cuEventSynchronize": (_ptr,),
    "cuStreamQuery": (_ptr,),
    "cuStreamSynchronize": (_ptr,),
    "cuLaunchKernel": (_ptr, _uint, _uint, _uint, _uint, _uint, _uint, _uint, _ptr, _ptr, _ptr),
    "cuGetErrorName": (_int, ctypes.POINTER(ctypes.c_char_p)),
    # setup of the D2H helper process's shared resources (syncless.cc._helper), once per GPU
    "cuMemAlloc_v2": (ctypes.POINTER(_u64), _size),
    "cuMemFree_v2": (_u64,),
    "cuEventCreate": (ctypes.POINTER(_ptr), _uint),
    "cuEventDestroy_v2": (_ptr,),
    "cuIpcGetMemHandle": (ctypes.c_char_p, _u64),
    "cuIpcGetEventHandle": (ctypes.c_char_p, _ptr),
    "cuDeviceGet": (ctypes.POINTER(_int), _int),
    "cuDeviceGetPCIBusId": (ctypes.c_char_p, _int, _int),
    "cuGetErrorString": (_int, ctypes.POINTER(ctypes.c_char_p)),
}
# Declared where the driver has them (a missing one is no error: its caller asks with hasattr first).
_OPTIONAL_SIGNATURES = {
    # a small upload carried in the command itself (syncless.cc._inline_h2d); the _v2 forms need no opt-in
    "cuStreamWriteValue32_v2": (_ptr, _u64, ctypes.c_uint32, _uint),
    "cuStreamWriteValue64_v2": (_ptr, _u64, _u64, _uint),
}
CUDA_ERROR_NOT_READY = 600


def _load_library() -> tuple[Any, Any]:
    """``libcuda`` opened twice: with the GIL held through calls, and without. Raises MissingDependencyError."""
    names = ["libcuda.so.1", "libcuda.so", "nvcuda.dll"]
    try:  # where cuda-bindings found it, if that is not on the loader's path
        from cuda import pathfinder

        names.insert(0, pathfinder.load_nvidia_dynamic_lib("cuda").abs_path)
    except Exception:  # noqa: BLE001 - an older cuda-bindings, or none: the loader's own search below
        pass
    problems = []
    for name in names:
        if not name:
            continue
        try:
            libs = ctypes.PyDLL(name), ctypes.CDLL(name)
            LOADED_FROM[0] = name
            return libs
        except OSError as err:
            problems.append(f"{name}: {err}")
    raise MissingDependencyError(
        "the CUDA driver library (libcuda) could not be opened through ctypes (" + "; ".join(problems) +
        "); install the NVIDIA driver, or put the directory of libcuda.so.1 on LD_LIBRARY_PATH")


def _declare(lib: Any) -> None:
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = _int
    for name, argtypes in _OPTIONAL_SIGNATURES.items():
        function = getattr(lib, name, None)
        if function is not None:
            function.argtypes = argtypes
            function.restype = _int


def libraries() -> tuple[Any, Any]:
    """``(quick, blocking)``: the driver library with the GIL held through a call, and released."""
    libs = _LIBS[0]
    if libs is None:
        with _lock:
            libs = _LIBS[0]
            if libs is None:
                quick, blocking = _load_library()
                _declare(quick)
                _declare(blocking)
                libs = _LIBS[0] = (quick, blocking)
    return libs


def raise_for(call: str, code: int) -> None:
    """Raise :class:`CudaError` for driver result ``code`` of ``call`` (nonzero)."""
    quick, _ = libraries()
    text = ctypes.c_char_p()
    name = f"CUresult {code}"
    if quick.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value:
        name = text.value.decode()
    explanation = "no description"
    if quick.cuGetErrorString(code, ctypes.byref(text)) == 0 and text.value:
        explanation = text.value.decode()
    raise CudaError(call, code, name, explanation)


def current_context() -> int:
    """The calling thread's current CUDA context handle (0: none). Host only; GIL held."""
    quick = (_LIBS[0] or libraries())[0]
    handle = getattr(_context_out, "handle", None)
    if handle is None:
        handle = _context_out.handle = _ptr()
    code = quick.cuCtxGetCurrent(handle)  # ctypes passes it by reference (the argument type is a pointer)
    if code:
        raise_for("cuCtxGetCurrent", code)
    return handle.value or 0


_context_out = threading.local()  # per thread: the out-parameter of cuCtxGetCurrent, made once

"""A stand-in for cupti-python and the CUDA driver under it, for the CPU tests of the CUPTI backend.

It stands in for the hardware and the driver only: which calls exist (the
callback ids, named as cupti-python 13.0 names them), the one-subscriber
rule, the callback at a call's entry and exit with the call's parameters
in memory laid out as the driver lays them out (``CUpti_CallbackData`` and
the ``*_params`` structs, one 8-byte word per field), and what memory an
address is. The backend's logic (which calls block, merging, attribution,
fallback) is the real one.

Register it as ``cupti`` (``sys.modules``); its own frames then count as
plumbing, like cupti-python's wrapper, so the user's frame is the caller of
:func:`call`.
"""

from __future__ import annotations

import ctypes
import enum
import sys
import time
import warnings

cupti = sys.modules[__name__]  # `from cupti import cupti` finds the API here, as in cupti-python

TORCH_SYNC_TEXT = "called a synchronizing CUDA operation"


class CallbackDomain(enum.IntEnum):
    INVALID = 0
    DRIVER_API = 1
    RUNTIME_API = 2


class ApiCallbackSite(enum.IntEnum):
    API_ENTER = 0
    API_EXIT = 1


class Result(enum.IntEnum):
    SUCCESS = 0
    ERROR_NOT_INITIALIZED = 15
    ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39


class cuptiError(Exception):  # noqa: N801 - cupti-python's name
    def __init__(self, status: int):
        super().__init__(f"CUPTI error {status}")
        self.status = status


_RUNTIME = [
    "cudaMalloc_v3020", "cudaFree_v3020", "cudaFreeHost_v3020", "cudaMemcpy_v3020", "cudaMemcpyAsync_v3020",
    "cudaMemcpy2D_v3020", "cudaMemset_v3020", "cudaMemsetAsync_v3020", "cudaStreamSynchronize_v3020",
    "cudaEventSynchronize_v3020", "cudaDeviceSynchronize_v3020", "cudaLaunchKernel_v7000",
    "cudaMemcpyAsync_ptsz_v7000", "cudaStreamSynchronize_ptsz_v7000", "cudaEventQuery_v3020",
]
_DRIVER = [
    "cuCtxSynchronize", "cuMemFree_v2", "cuMemFreeHost", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2",
    "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyAsync", "cuMemsetD8_v2", "cuStreamSynchronize",
    "cuEventSynchronize", "cuLaunchKernel", "cuMemUnmap", "cuMemRelease", "cuCtxSynchronize_v2",
]
runtime_api_trace_cbid = enum.IntEnum("runtime_api_trace_cbid", {name: i + 1 for i, name in enumerate(_RUNTIME)})
driver_api_trace_cbid = enum.IntEnum("driver_api_trace_cbid", {name: i + 1 for i, name in enumerate(_DRIVER)})


class _CallbackStruct(ctypes.Structure):
    _fields_ = [
        ("callbackSite", ctypes.c_int),
        ("functionName", ctypes.c_char_p),
        ("functionParams", ctypes.c_void_p),
        ("functionReturnValue", ctypes.c_void_p),
        ("symbolName", ctypes.c_char_p),
        ("context", ctypes.c_void_p),
        ("contextUid", ctypes.c_uint32),
        ("correlationData", ctypes.c_void_p),
        ("correlationId", ctypes.c_uint32),
    ]


class CallbackData:
    """What cupti-python hands the callback: a view of ``CUpti_CallbackData`` with ``ptr`` its address."""

    def __init__(self, struct: _CallbackStruct):
        self._struct = struct
        self.callback_site = struct.callbackSite
        self.function_name = struct.functionName.decode()
        self.ptr = ctypes.addressof(struct)


class _Driver:
    """The process's CUPTI state: subscribers, enabled ids, and what each address is."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.subscribers: dict[int, tuple[object, set[tuple[int, int]]]] = {}
        self.other_tool = False
        self.refuse_with: int | None = None
        self.next_handle = 1
        self.subscribe_calls = 0


driver = _Driver()


def hold_by_other_tool(held: bool = True) -> None:
    """Let another tool (kineto) hold the one CUPTI subscription."""
    driver.other_tool = held


def subscribe(callback, userdata) -> int:
    driver.subscribe_calls += 1
    if driver.refuse_with is not None:
        raise cuptiError(driver.refuse_with)
    if driver.other_tool or driver.subscribers:
        raise cuptiError(Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)
    handle = driver.next_handle
    driver.next_handle += 1
    driver.subscribers[handle] = (callback, set())
    return handle


def unsubscribe(handle: int) -> None:
    driver.subscribers.pop(handle)


def enable_callback(enable: int, subscriber: int, domain: int, cbid: int) -> None:
    ids = driver.subscribers[subscriber][1]
    (ids.add if enable else ids.discard)((int(domain), int(cbid)))


def _callback_id(name: str) -> tuple[int, int]:
    if name.startswith("cuda"):
        for member_name, member in runtime_api_trace_cbid.__members__.items():
            if member_name.rpartition("_v")[0] == name:
                return int(CallbackDomain.RUNTIME_API), int(member)
        raise KeyError(name)
    return int(CallbackDomain.DRIVER_API), int(driver_api_trace_cbid[name])


def call(name: str, params=(), body=None):
    """Make CUDA call ``name`` with its parameter words; ``body`` is what the call does (nested calls, waiting)."""
    key = _callback_id(name)
    words = (ctypes.c_uint64 * max(len(params), 1))(*params)
    struct = _CallbackStruct(0, name.encode(), ctypes.addressof(words))
    targets = [cb for cb, ids in list(driver.subscribers.values()) if key in ids]
    for callback in targets:
        struct.callbackSite = ApiCallbackSite.API_ENTER
        callback(None, key[0], key[1], CallbackData(struct))
    result = body() if body is not None else None
    for callback in targets:
        struct.callbackSite = ApiCallbackSite.API_EXIT
        callback(None, key[0], key[1], CallbackData(struct))
    return result


def torch_op(calls, warn: bool = True):
    """What a synchronizing torch op does: its CUDA calls, then the warning torch buffered until it returns."""
    for name, params in calls:
        call(name, params)
    if warn:
        warnings.warn(TORCH_SYNC_TEXT + " (Triggered internally at c10/cuda/CUDAFunctions.cpp:1.)", UserWarning)


def warn_then_call(calls):
    """A synchronizing op whose warning is not held back: the warning first, then its CUDA calls."""
    warnings.warn(TORCH_SYNC_TEXT + " (Triggered internally at c10/cuda/CUDAFunctions.cpp:1.)", UserWarning)
    for name, params in calls:
        call(name, params)


def wait_ms(ms: float):
    """A call body that keeps the host in the call for at least ``ms`` milliseconds."""
    return lambda: time.sleep(ms / 1000)


# Addresses and what memory they are (the stand-in's pointer-attribute answers).
DEVICE_ADDR = 0x7F00_0000_1000
PINNED_ADDR = 0x7F00_0000_2000
PAGEABLE_ADDR = 0x5500_0000_3000
MANAGED_ADDR = 0x7F00_0000_4000
MEMORY = {DEVICE_ADDR: "device", PINNED_ADDR: "pinned", PAGEABLE_ADDR: "pageable", MANAGED_ADDR: "managed"}


def pointer_types(address: int) -> str:
    return MEMORY.get(address, "pageable")


def synchronize_device(device=None):
    """Stands in for ``torch.cuda.synchronize`` (torch's frames are plumbing too): one cudaDeviceSynchronize."""
    return call("cudaDeviceSynchronize", body=wait_ms(2))

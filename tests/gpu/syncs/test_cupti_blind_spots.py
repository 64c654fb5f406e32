"""Syncs the torch backend cannot see, caught by the CUPTI backend at the right line.

Each test makes one host-blocking CUDA call that does not go through torch's
sync check or syncless's wrappers (the allocator, cuda-bindings, cupy, a
C++/CUDA extension, a thread of its own) and checks the report: one row at
that line, seen by ``cupti`` only, naming the call. The torch backend is run
on the same code first, as the oracle of what it misses.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from syncless import syncs

from .cupti_fixtures import cupti_detector, rows_at  # noqa: F401 - fixtures used by name

HERE = Path(__file__).name
BUSY_CYCLES = 20_000_000  # ~10 ms of GPU work queued before each sync, so that the wait is real


def here() -> int:
    """The line number of the caller's next line."""
    return sys._getframe(1).f_lineno + 1


def only_row(line: int, *apis: str):
    """The report's one row at ``line``; it must be CUPTI's alone and name one of ``apis``."""
    found = syncs.report()
    rows = rows_at(found, HERE, line)
    assert len(rows) == 1 and len(found.sites) == 1, found.format()
    (row,) = rows
    print(f"line {line}: {row.count}x, seen by {'+'.join(row.layers)}, {row.api_calls}, "
          f"blocked {row.blocked_total_ns / 1000:.1f} us (max {row.blocked_max_ns / 1000:.1f} us)")
    assert row.layers == ("cupti",), found.format()
    assert set(row.api_calls) & set(apis), f"expected one of {apis}: {found.format()}"
    assert row.timed_count == row.count >= 1
    return row


@pytest.fixture
def drv(cuda_device):
    from cuda.bindings import driver

    torch.cuda.init()
    return driver


def ok(result):
    """Unpack a cuda-bindings result, failing the test on an error."""
    from cuda.bindings import driver

    err, *values = result if isinstance(result, tuple) else (result,)
    assert err == driver.CUresult.CUDA_SUCCESS or getattr(err, "value", 1) == 0, err
    return values[0] if len(values) == 1 else values


def busy():
    torch.cuda._sleep(BUSY_CYCLES)


@pytest.mark.gpu
def test_empty_cache_with_cached_blocks(cupti_detector):  # noqa: F811
    blocks = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
    del blocks
    torch.cuda.synchronize()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert cached >= 3 * (64 << 20)
    busy()
    with syncs.checking():
        line = here()
        torch.cuda.empty_cache()
    only_row(line, "cudaFree", "cudaDeviceSynchronize", "cudaStreamSynchronize", "cuMemFree_v2")
    # The open question: a second empty_cache() finds no whole free segment left, so it frees nothing
    # and calls no cudaFree: it does not block. Only cached, entirely free segments are released.
    syncs.reset()
    print(f"cached after the first empty_cache: {torch.cuda.memory_reserved() - torch.cuda.memory_allocated()} bytes")
    busy()
    with syncs.checking():
        torch.cuda.empty_cache()
    assert not syncs.report(), syncs.report().format()
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_raw_stream_synchronize_through_cuda_bindings(cupti_detector, drv):  # noqa: F811
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    busy()
    with syncs.checking():
        line = here()
        ok(drv.cuStreamSynchronize(stream))
    only_row(line, "cuStreamSynchronize", "cuStreamSynchronize_ptsz")


@pytest.mark.gpu
def test_raw_context_synchronize(cupti_detector, drv):  # noqa: F811
    busy()
    with syncs.checking():
        line = here()
        ok(drv.cuCtxSynchronize())
    only_row(line, "cuCtxSynchronize", "cuCtxSynchronize_v2")


@pytest.mark.gpu
def test_raw_event_synchronize_on_a_torch_event(cupti_detector, drv):  # noqa: F811
    event = torch.cuda.Event()
    busy()
    event.record()
    with syncs.checking():
        line = here()
        ok(drv.cuEventSynchronize(drv.CUevent(event.cuda_event)))
    only_row(line, "cuEventSynchronize")


@pytest.mark.gpu
def test_device_and_pinned_frees_through_cuda_bindings(cupti_detector, drv):  # noqa: F811
    device_ptr = ok(drv.cuMemAlloc(1 << 20))
    busy()
    with syncs.checking():
        line = here()
        ok(drv.cuMemFree(device_ptr))
    only_row(line, "cuMemFree_v2")
    syncs.reset()
    host_ptr = ok(drv.cuMemAllocHost(1 << 20))
    busy()
    with syncs.checking():
        line = here()
        ok(drv.cuMemFreeHost(host_ptr))
    only_row(line, "cuMemFreeHost")


@pytest.mark.gpu
def test_cuda_free_host_through_the_runtime(cupti_detector):  # noqa: F811
    from cuda.bindings import runtime

    host_ptr = ok(runtime.cudaMallocHost(1 << 20))
    busy()
    with syncs.checking():
        line = here()
        ok(runtime.cudaFreeHost(host_ptr))
    only_row(line, "cudaFreeHost", "cuMemFreeHost")


@pytest.mark.gpu
def test_synchronous_memset_of_pinned_memory_blocks_and_of_device_memory_does_not(cupti_detector, drv):  # noqa: F811
    host_ptr = ok(drv.cuMemAllocHost(1 << 20))
    device_ptr = ok(drv.cuMemAlloc(1 << 20))
    try:
        busy()
        with syncs.checking():
            ok(drv.cuMemsetD8(device_ptr, 7, 1 << 20))  # device memory: asynchronous to the host
            line = here()
            ok(drv.cuMemsetD8(drv.CUdeviceptr(int(host_ptr)), 7, 1 << 20))
        only_row(line, "cuMemsetD8_v2")
    finally:
        torch.cuda.synchronize()
        ok(drv.cuMemFreeHost(host_ptr))
        ok(drv.cuMemFree(device_ptr))


@pytest.mark.gpu
def test_synchronous_copy_into_pageable_memory_through_cuda_bindings(cupti_detector, drv):  # noqa: F811
    source = torch.randn(1 << 16, device="cuda")
    host = np.full(source.numel(), np.nan, dtype=np.float32)
    busy()
    with syncs.checking():
        line = here()
        ok(drv.cuMemcpyDtoH(host.ctypes.data, source.data_ptr(), source.numel() * 4))
    only_row(line, "cuMemcpyDtoH_v2")
    assert np.array_equal(host, source.cpu().numpy())


@pytest.mark.gpu
def test_async_copies_between_device_and_pinned_memory_stay_silent(cupti_detector, drv):  # noqa: F811
    pinned = torch.randn(1 << 16).pin_memory()
    target = torch.full((1 << 16,), float("nan"), device="cuda")
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    busy()
    with syncs.checking():
        ok(drv.cuMemcpyHtoDAsync(target.data_ptr(), pinned.data_ptr(), pinned.numel() * 4, stream))
        ok(drv.cuMemcpyDtoHAsync(pinned.data_ptr(), target.data_ptr(), pinned.numel() * 4, stream))
    assert not syncs.report(), syncs.report().format()
    torch.cuda.synchronize()


@pytest.fixture
def cupy():
    return pytest.importorskip("cupy")


@pytest.mark.gpu
def test_cupy_stream_synchronize(cupti_detector, cupy):  # noqa: F811
    x = cupy.random.random(1 << 20)
    y = x * 2  # noqa: F841 - queued work
    busy()
    with syncs.checking():
        line = here()
        cupy.cuda.get_current_stream().synchronize()
    only_row(line, "cudaStreamSynchronize", "cudaStreamSynchronize_ptsz", "cuStreamSynchronize")


@pytest.mark.gpu
def test_cupy_get_into_pageable_memory(cupti_detector, cupy):  # noqa: F811
    x = cupy.random.random(1 << 16)
    busy()
    with syncs.checking():
        line = here()
        back = x.get()
    only_row(line, "cudaMemcpy", "cudaMemcpyAsync", "cudaStreamSynchronize", "cuMemcpyDtoH_v2", "cuMemcpy")
    assert np.array_equal(back, cupy.asnumpy(x))


EXTENSION_SOURCE = r"""
#include <cuda_runtime.h>
#include <cstdint>
#include <vector>

#ifdef SYNCLESS_PLAIN_LIBRARY
#define PROBE_API extern "C"
#else
#define PROBE_API
#endif

PROBE_API int64_t stream_sync(int64_t stream) {
    return static_cast<int64_t>(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
}

PROBE_API double copy_sum(int64_t device_ptr, int64_t n) {
    std::vector<float> host(static_cast<size_t>(n));
    cudaMemcpy(host.data(), reinterpret_cast<const void*>(device_ptr), n * sizeof(float), cudaMemcpyDeviceToHost);
    double sum = 0;
    for (float v : host) sum += v;
    return sum;
}
"""


def _plain_library(build: Path):
    """The same source as a plain shared library loaded with ctypes (where ninja is missing)."""
    import ctypes
    import subprocess

    from torch.utils.cpp_extension import CUDA_HOME

    source, library = build / "probe.cpp", build / "libsyncless_cupti_probe.so"
    if not library.exists():
        source.write_text(EXTENSION_SOURCE)
        lib64 = Path(CUDA_HOME) / "lib64"
        subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-DSYNCLESS_PLAIN_LIBRARY", f"-I{Path(CUDA_HOME) / 'include'}",
                        str(source), "-o", str(library), f"-L{lib64}", f"-Wl,-rpath,{lib64}", "-lcudart"],
                       check=True, timeout=300)
    lib = ctypes.CDLL(str(library))
    lib.stream_sync.argtypes, lib.stream_sync.restype = [ctypes.c_int64], ctypes.c_int64
    lib.copy_sum.argtypes, lib.copy_sum.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_double
    return lib


@pytest.fixture(scope="module")
def extension():
    """A C++ extension that calls the CUDA runtime itself (built once, cached in the temp dir).

    Built with torch.utils.cpp_extension.load_inline; where ninja (which
    load_inline needs) is missing, the same source is built as a plain
    library with g++ and loaded with ctypes. Either way the calls go from
    the test's line straight into C++.
    """
    from torch.utils import cpp_extension

    build = Path(tempfile.gettempdir()) / f"syncless-cupti-ext-{torch.__version__.replace('+', '_')}"
    build.mkdir(parents=True, exist_ok=True)
    if not cpp_extension.is_ninja_available():
        print(f"ninja is missing: building the probe as a plain library in {build}", flush=True)
        return _plain_library(build)
    print(f"building the probe extension with load_inline in {build} (cached; ~1 min the first time)", flush=True)
    return cpp_extension.load_inline(name="syncless_cupti_probe", cpp_sources=EXTENSION_SOURCE,
                                     functions=["stream_sync", "copy_sum"], with_cuda=True,
                                     build_directory=str(build), extra_cflags=["-O1"], verbose=False)


@pytest.mark.gpu
def test_cpp_extension_stream_synchronize_and_blocking_copy(cupti_detector, extension):  # noqa: F811
    values = torch.randn(4096, device="cuda")
    expected = float(values.double().sum())
    pointer, count = values.data_ptr(), values.numel()
    busy()
    with syncs.checking():
        line = here()
        assert extension.stream_sync(torch.cuda.current_stream().cuda_stream) == 0
    only_row(line, "cudaStreamSynchronize", "cudaStreamSynchronize_ptsz")
    syncs.reset()
    busy()
    with syncs.checking():
        line = here()
        total = extension.copy_sum(pointer, count)
    only_row(line, "cudaMemcpy", "cudaMemcpy_ptds")
    assert abs(total - expected) <= 1e-3 * max(1.0, abs(expected))


@pytest.mark.gpu
def test_a_thread_syncless_never_saw_start(cupti_detector, drv):  # noqa: F811
    go, lines, errors = threading.Event(), [], []
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)

    def worker():
        try:
            go.wait(60)
            torch.cuda.set_device(0)
            with syncs.checking():
                lines.append(here())
                ok(drv.cuStreamSynchronize(stream))
        except BaseException as err:  # handed to the main thread
            errors.append(err)

    thread = threading.Thread(target=worker, name="started-before-any-region")
    thread.start()  # before CUPTI is subscribed: no region is active yet
    busy()
    go.set()
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
    row = only_row(lines[0], "cuStreamSynchronize", "cuStreamSynchronize_ptsz")
    assert row.first.thread == "started-before-any-region"


@pytest.mark.gpu
def test_the_torch_backend_misses_all_of_these(cuda_device, drv):
    """The oracle: with the torch backend the same raw calls leave the report empty."""
    mode_before = syncs.mode()
    from syncless.syncs import _backend

    backend_before = _backend.backend.requested
    syncs.set_mode("record")
    syncs.set_backend("torch")
    syncs.reset()
    assert syncs.enable()
    try:
        blocks = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
        del blocks
        stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
        with syncs.checking():
            torch.cuda.empty_cache()
            ok(drv.cuStreamSynchronize(stream))
            ok(drv.cuCtxSynchronize())
        assert not syncs.report(), syncs.report().format()
    finally:
        syncs.disable()
        syncs.reset()
        syncs.set_backend(backend_before)
        syncs.set_mode(mode_before)

"""Raw CUDA pieces of ``syncless bench pp``: the physical baseline and the full-SM kernel.

* :class:`PeerBuffer`: one ``cuMemAlloc`` buffer per rank (a page of 64-bit
  flags, then a data region), opened by the other rank over legacy CUDA IPC.
  The raw peer copy (``cuMemcpyAsync`` into the peer's region) and the raw flag
  ping-pong (``cuStreamWriteValue64`` on the peer's flag,
  ``cuStreamWaitValue64`` on one's own) use it: no transport, no SM.
* :class:`SpinKernel`: a kernel that needs every SM (one CTA per SM, held
  there by its dynamic shared memory) spinning a fixed number of cycles,
  compiled at run time with NVRTC (no compiled extension of ours).
* :class:`Gate`: holds a stream with ``torch.cuda._sleep`` so the host can
  enqueue a whole timed loop before the GPU starts it.
* :func:`sync_device`: ``torch.cuda.synchronize`` that gives up with an error
  instead of hanging when a stream waits on a flag that never comes.

The context, the buffer's allocation and IPC calls, the copies and the flag
writes and waits are the copy-engine transport's own (:mod:`syncless.pp._driver`),
so the baseline issues exactly the driver calls the transport does; the rest
goes through :mod:`syncless._core.cuda`. torch and cuda-bindings are imported
on first use only. The enqueueing helpers take the stream explicitly (a torch
stream) and never block the host; :meth:`Gate.hold` enqueues on the current
stream, and :class:`PeerBuffer`'s set-up synchronizes its context.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any

from syncless._core import cuda
from syncless._core.errors import MissingDependencyError

if TYPE_CHECKING:
    from syncless.pp._driver import Hot, PrimaryContext

FLAG_REGION_NBYTES = 4096  # flags live in the first page; data starts page-aligned after it


def _pp_driver() -> ModuleType:
    # Imported on first use: syncless.pp imports torch, which a worker loads
    # only after it has set its environment (SAFE_ENV).
    from syncless.pp import _driver

    return _driver


def bind_primary_context(ordinal: int) -> PrimaryContext:
    """Make GPU ``ordinal``'s primary context (the one torch uses) current on this thread.

    Retains it (drop that with the returned context's ``release()``) so that
    the driver calls of this module run in torch's context whatever the
    runtime left current. Blocks the host only on first use of the GPU.
    """
    context = _pp_driver().PrimaryContext(ordinal)
    try:
        context.make_current()
    except BaseException:
        context.release()
        raise
    return context


def stream_handle(stream: Any) -> Any:
    """Return the driver handle of a torch stream."""
    return cuda.ensure_driver().CUstream(int(stream.cuda_stream))


@functools.cache
def _hot() -> Hot:
    # One set of bound driver calls per process, made on first use (never at import).
    return _pp_driver().Hot()


def memcpy_async(dst: int, src: int, nbytes: int, stream: Any) -> None:
    """Enqueue a copy of ``nbytes`` from ``src`` to ``dst`` (any GPUs, unified addresses) on ``stream``.

    Between two GPUs this runs on a copy engine. Does not block the host.
    """
    _hot().memcpy(dst, src, nbytes, stream.cuda_stream)


def write_flag(address: int, value: int, stream: Any) -> None:
    """Enqueue ``*address = value`` (64-bit) on ``stream``, after all its earlier work. Does not block the host."""
    _hot().write(stream.cuda_stream, address, value)


def wait_flag(address: int, value: int, stream: Any) -> None:
    """Make ``stream`` wait until ``*address >= value`` (64-bit), holding no SM. Does not block the host."""
    _hot().wait_geq(stream.cuda_stream, address, value)


class PeerBuffer:
    """This rank's IPC-shareable buffer (flags page + data region), and the peer's buffer opened here.

    Life cycle, on both ranks: ``PeerBuffer(nbytes)`` -> exchange
    :attr:`handle_bytes` over gloo -> :meth:`open_peer` -> use ->
    :meth:`close_peer` -> barrier -> :meth:`free` (the owner frees only after
    the peer has closed its mapping).
    """

    def __init__(self, data_nbytes: int):
        drv = _pp_driver()
        self.data_nbytes = data_nbytes
        self.local = drv.mem_alloc(FLAG_REGION_NBYTES + data_nbytes)
        self.peer: int | None = None
        try:
            # Zero the flags before the handle is shared: a peer's first wait must
            # not see stale memory. The fill is enqueued on the legacy default
            # stream (handle 0), hence the context synchronize.
            drv.mem_zero(self.local, FLAG_REGION_NBYTES + data_nbytes, 0)
            cuda.call("cuCtxSynchronize")
            self.handle_bytes = drv.ipc_handle(self.local)
        except BaseException:
            self.free()
            raise

    @property
    def local_flag(self) -> int:
        """Address of this rank's flag (the peer writes it, this rank waits on it)."""
        return self.local

    @property
    def local_data(self) -> int:
        return self.local + FLAG_REGION_NBYTES

    @property
    def peer_flag(self) -> int:
        return self._peer()

    @property
    def peer_data(self) -> int:
        return self._peer() + FLAG_REGION_NBYTES

    def _peer(self) -> int:
        if self.peer is None:
            raise RuntimeError("the peer's buffer is not open; call open_peer() first")
        return self.peer

    def open_peer(self, handle_bytes: bytes) -> None:
        """Map the peer's buffer into this context (peer access enabled lazily). Blocks the host briefly."""
        self.peer = _pp_driver().ipc_open(handle_bytes)

    def close_peer(self) -> None:
        """Unmap the peer's buffer (call after every copy into it has finished)."""
        if self.peer is not None:
            _pp_driver().ipc_close(self.peer)
            self.peer = None

    def free(self) -> None:
        """Free this rank's buffer (call after the peer closed its mapping)."""
        if self.local:
            _pp_driver().mem_free(self.local)
            self.local = 0


# The full-SM kernel --------------------------------------------------------------

SPIN_KERNEL_NAME = "syncless_bench_spin_all_sms"
SPIN_KERNEL_SOURCE = r"""
extern "C" __global__ void syncless_bench_spin_all_sms(long long cycles)
{
    // The dynamic shared memory is what matters: requested at launch, it keeps
    // a second CTA off each SM, so the grid needs every SM at once.
    extern __shared__ unsigned char held[];
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
    if (threadIdx.x == 0) {
        held[0] = (unsigned char)blockIdx.x;
    }
}
"""
SPIN_BLOCK_THREADS = 128
SPIN_SHARED_NBYTES = 200 * 1024


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as err:
        raise MissingDependencyError(
            "cuda.bindings.nvrtc is not importable; the full-SM interference kernel is compiled with NVRTC: "
            "install cuda-bindings (`pip install 'syncless[cuda]'`)"
        ) from err
    return nvrtc


def _nvrtc_check(nvrtc: Any, what: str, result: Any) -> Any:
    code = result[0] if isinstance(result, tuple) else result
    if code != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed with {code}")
    if isinstance(result, tuple) and len(result) > 1:
        return result[1] if len(result) == 2 else result[1:]
    return None


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """Compile CUDA C ``source`` for ``arch`` (e.g. ``"sm_90"``) with NVRTC; return the CUBIN. Host only.

    Raises:
        MissingDependencyError: NVRTC (the library or its binding) is missing.
        RuntimeError: compilation failed; the message carries NVRTC's log.
    """
    nvrtc = _nvrtc()
    try:
        created = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    except RuntimeError as err:  # cuda.pathfinder's DynamicLibNotFoundError: libnvrtc.so is absent
        raise MissingDependencyError(
            f"the NVRTC library was not found ({err}); install the NVRTC wheel of your CUDA major version, "
            "e.g. `pip install nvidia-cuda-nvrtc`"
        ) from err
    program = _nvrtc_check(nvrtc, "nvrtcCreateProgram", created)
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
        compiled = nvrtc.nvrtcCompileProgram(program, len(options), options)
        code = compiled[0] if isinstance(compiled, tuple) else compiled
        if code != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = _nvrtc_check(nvrtc, "nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(program))
            log = b" " * int(size)
            _nvrtc_check(nvrtc, "nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(program, log))
            raise RuntimeError(f"NVRTC could not compile {name} for {arch} ({code}): {log.decode(errors='replace')}")
        size = _nvrtc_check(nvrtc, "nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(program))
        cubin = b" " * int(size)
        _nvrtc_check(nvrtc, "nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(program, cubin))
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return cubin


class SpinKernel:
    """A kernel that occupies every SM (grid = SM count, one CTA per SM) for a fixed number of cycles.

    Built on GPU ``ordinal`` (whose primary context must be current).
    :attr:`ctas_per_sm` is the driver's occupancy answer, which must be 1 for
    the kernel to mean "needs every SM at once".
    """

    def __init__(self, ordinal: int, capability: tuple[int, int]):
        drv = cuda.ensure_driver()
        arch = f"sm_{capability[0]}{capability[1]}"
        cubin = compile_cubin(SPIN_KERNEL_SOURCE, SPIN_KERNEL_NAME, arch)
        image = ctypes.create_string_buffer(cubin, len(cubin))
        self.module = cuda.call("cuModuleLoadData", ctypes.addressof(image))
        self.function = cuda.call("cuModuleGetFunction", self.module, SPIN_KERNEL_NAME.encode())
        self.sm_count = cuda.device_attribute(ordinal, "MULTIPROCESSOR_COUNT")
        optin = cuda.device_attribute(ordinal, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        per_sm = cuda.device_attribute(ordinal, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
        # Enough shared memory that two CTAs never fit on one SM, within the per-block limit.
        self.shared_nbytes = min(optin, max(SPIN_SHARED_NBYTES, per_sm // 2 + 1))
        attribute = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        cuda.call("cuFuncSetAttribute", self.function, attribute, self.shared_nbytes)
        self.ctas_per_sm = int(
            cuda.call(
                "cuOccupancyMaxActiveBlocksPerMultiprocessor", self.function, SPIN_BLOCK_THREADS, self.shared_nbytes
            )
        )
        if self.ctas_per_sm != 1:
            raise RuntimeError(
                f"the full-SM kernel must fit exactly one CTA per SM; with {self.shared_nbytes} bytes of shared "
                f"memory the driver fits {self.ctas_per_sm} (per-SM {per_sm}, per-block opt-in {optin})"
            )

    def launch(self, cycles: int, stream: Any) -> None:
        """Enqueue one launch spinning ``cycles`` SM clocks on every SM, on ``stream``. Does not block the host."""
        argument = ctypes.c_longlong(int(cycles))
        params = (ctypes.c_void_p * 1)(ctypes.addressof(argument))
        cuda.call(
            "cuLaunchKernel",
            self.function,
            self.sm_count, 1, 1,
            SPIN_BLOCK_THREADS, 1, 1,
            self.shared_nbytes,
            stream_handle(stream),
            ctypes.addressof(params),
            0,
        )  # fmt: skip

    def unload(self) -> None:
        cuda.call("cuModuleUnload", self.module)


# Host-side helpers -----------------------------------------------------------------


class Gate:
    """Holds a stream for a given time with ``torch.cuda._sleep``, calibrated on this GPU.

    The timed loops enqueue a gate first, then the whole loop: the host gets
    ahead of the GPU, so the loop measures the GPU alone. :meth:`hold`
    returns an event recorded after the sleep; if it is still pending when
    the host has finished enqueuing, the host was ahead the whole time.
    """

    CALIBRATION_CYCLES = 2_000_000

    def __init__(self) -> None:
        import torch

        best_ms = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(self.CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
            best_ms = min(best_ms, start.elapsed_time(end))
        self.cycles_per_ms = self.CALIBRATION_CYCLES / max(best_ms, 1e-3)

    def hold(self, ms: float) -> Any:
        """Enqueue a ``ms`` sleep on the current stream; return an event recorded after it."""
        import torch

        torch.cuda._sleep(max(1, int(ms * self.cycles_per_ms)))
        done = torch.cuda.Event()
        done.record()
        return done


def sync_device(device: Any, timeout_s: float, what: str) -> None:
    """Wait for all GPU work on ``device``, at most ``timeout_s``; blocks the host.

    The wait runs on a helper thread so that a stream stuck on a flag (a
    broken peer) turns into an error here instead of a hang.

    Raises:
        TimeoutError: the GPU did not drain in time.
    """
    import torch

    done = threading.Event()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            torch.cuda.synchronize(device)
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            errors.append(err)
        finally:
            done.set()

    threading.Thread(target=wait, name="syncless-bench-sync", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(
            f"{what}: the GPU did not finish within {timeout_s:g} s "
            "(a stream is waiting for a peer or a flag that never came)"
        )
    if errors:
        raise errors[0]

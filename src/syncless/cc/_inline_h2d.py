"""Small H2D copies as one kernel launch: the bytes travel in the launch's parameters, not through a copy.

Under CC, a host<->device ``cudaMemcpy*`` returns only once it is done, since
the driver encrypts the data through bounce buffers. A kernel launch stays
asynchronous: its commands and parameters cross in the driver's own
(encrypted) command channel. So an upload of at most
:data:`INLINE_MAX_BYTES` (a decode step's token ids and positions) is
written by a tiny kernel whose parameters hold the bytes::

    host    : read src's bytes now; launch K(dst, n, bytes) on the current stream; return
    current : ... earlier work ... [K: dst <- bytes] consumer

Nothing waits: no transfer, no staging stream, no event, no cross-stream
wait. Stream order is torch's: the kernel runs on the current stream where
torch's copy would, and ``dst`` is allocated on that stream. The host reads
the source at the call, as CC itself does (its copy has finished when the
call returns) and as the staging stream does; so the caller first settles
any copy still writing that host memory (:mod:`._host_writes`: the fast lane
leaves such a source to the staging path).

The kernel is PTX text below (one entry per parameter size, so that an
8-byte upload does not carry 4 KiB of parameters), loaded by the driver's
JIT at the first upload on each GPU: no compiler and no compiled extension
at install. Its launch is one ``cuLaunchKernel`` through ctypes, with the
whole parameter block passed as one buffer (``CU_LAUNCH_PARAM_BUFFER_POINTER``):
``dst`` (8 bytes), ``nbytes`` (4, then 4 of padding), the payload. Host
cost: one allocation, one ``memmove`` and the launch (docs/cc.md has the
count). If the module cannot be loaded on a GPU, or a launch there fails,
uploads there go the staging way (logged once; a load that ran out of
memory is tried again at the next upload).

An upload of exactly 4 or 8 bytes into an aligned destination (a batch-1
step's token id or position) is not a kernel at all but one stream memory
operation, ``cuStreamWriteValue32/64``, whose command carries the value:
stream-ordered like the kernel, after a memory fence (the default flags), and
about a third of a launch's host time (docs/cc.md). Where the GPU lacks
64-bit stream memory operations, or the driver refuses one, those uploads
take the kernel (logged once).
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading

from syncless._core import libcuda
from syncless._core.errors import CudaError

_log = logging.getLogger(__name__)

_HEADER = 16  # dst (u64), nbytes (u32), padding: the payload starts 8-aligned
PAYLOAD_SIZES = (48, 496, 4080)  # parameter blocks of 64 B, 512 B and 4 KiB (the launch limit) in all
INLINE_MAX_BYTES = PAYLOAD_SIZES[-1]
_THREADS = 256  # one byte per thread

_CU_LAUNCH_PARAM_END = 0
_CU_LAUNCH_PARAM_BUFFER_POINTER = 1
_CU_LAUNCH_PARAM_BUFFER_SIZE = 2


def _entry_name(payload: int) -> str:
    return f"syncless_h2d_inline_{payload}"


def _entry_ptx(payload: int) -> str:
    """One kernel: thread ``i`` of the grid copies byte ``i`` of its ``payload`` parameter to ``dst + i``."""
    return f"""
.visible .entry {_entry_name(payload)}(
\t.param .u64 dst,
\t.param .u32 nbytes,
\t.param .align 8 .b8 payload[{payload}]
)
{{
\t.reg .pred %p;
\t.reg .b16 %byte;
\t.reg .b32 %r<5>;
\t.reg .b64 %rd<6>;

\tld.param.u64 %rd1, [dst];
\tld.param.u32 %r1, [nbytes];
\tmov.u32 %r2, %ctaid.x;
\tmov.u32 %r3, %ntid.x;
\tmov.u32 %r4, %tid.x;
\tmad.lo.s32 %r2, %r2, %r3, %r4;
\tsetp.ge.u32 %p, %r2, %r1;
\t@%p bra DONE;
\tmov.b64 %rd2, payload;
\tcvt.u64.u32 %rd3, %r2;
\tadd.s64 %rd4, %rd2, %rd3;
\tld.param.u8 %byte, [%rd4];
\tcvta.to.global.u64 %rd5, %rd1;
\tadd.s64 %rd5, %rd5, %rd3;
\tst.global.u8 [%rd5], %byte;
DONE:
\tret;
}}
"""


def module_ptx() -> str:
    """The PTX module the driver loads: one entry per :data:`PAYLOAD_SIZES` size."""
    head = ".version 7.0\n.target sm_70\n.address_size 64\n"
    return head + "".join(_entry_ptx(size) for size in PAYLOAD_SIZES)


_lock = threading.Lock()
_FUNCTIONS: dict[int, tuple[int, ...] | None] = {}  # GPU index -> its entries' handles (None: could not load)
_WORD_WRITES: dict[int, bool] = {}  # GPU index -> 4- and 8-byte uploads go as one stream memory op (set at _load)
_OTHER_FAILURES_LOGGED: set[int] = set()  # GPUs where a word write failed with a code not in _REFUSALS (logged)
_u32_at = ctypes.c_uint32.from_address
_u64_at = ctypes.c_uint64.from_address
_RETRY = object()  # what _load returns when the load may work later (out of memory)
_local = threading.local()  # per host thread: its parameter blocks (a launch copies them; a thread reuses its own)


def _load(index: int) -> tuple[int, ...] | None:
    """Load the module on GPU ``index`` (its primary context); return the entries' handles, or None (logged)."""
    from syncless.cc import _raw

    drv = _raw._drv()
    try:
        with _raw.InContext(index):
            module = _raw._ok("cuModuleLoadData", drv.cuModuleLoadData(module_ptx().encode() + b"\0"))
            entries = tuple(int(_raw._ok("cuModuleGetFunction",
                                         drv.cuModuleGetFunction(module, _entry_name(size).encode())))
                            for size in PAYLOAD_SIZES)
        _WORD_WRITES[index] = _can_write_words(index)
        return entries
    except Exception as err:  # noqa: BLE001 - no inline uploads on this GPU: the staging path stays correct
        if getattr(err, "name", "") == "CUDA_ERROR_OUT_OF_MEMORY":
            _log.info("syncless.cc: no memory to load the inline-upload kernel on cuda:%d now; tried again at the "
                      "next small upload", index)
            return _RETRY
        _log.warning("syncless.cc: the inline-upload kernel could not be loaded on cuda:%d (%s); small H2D copies "
                     "there are staged instead", index, err)
        return None


def _can_write_words(index: int) -> bool:
    """Whether GPU ``index`` takes 64-bit stream memory operations and the driver has their ``_v2`` entry points.

    Any error asking says no (logged at debug): word writes are an optimization, and a failed question must not
    cost the GPU its inline kernel (:func:`_load` gives that up on any exception it sees).
    """
    from syncless._core import cuda

    try:
        quick = libcuda.libraries()[0]
        if not (hasattr(quick, "cuStreamWriteValue32_v2") and hasattr(quick, "cuStreamWriteValue64_v2")):
            return False
        return bool(cuda.supports_64bit_stream_mem_ops(index))
    except Exception as err:  # noqa: BLE001 - see the docstring
        _log.debug("syncless.cc: could not ask whether cuda:%d takes 64-bit stream memory ops (%s); 4- and 8-byte "
                   "uploads there take the inline kernel", index, err)
        return False


# What a refused stream memory op returns when the op itself is what the driver will not do (nothing enqueued):
# CUDA_ERROR_INVALID_VALUE (a flag or address it does not take) and CUDA_ERROR_NOT_SUPPORTED. Only these turn word
# writes off for good; any other code (a context being torn down, a sticky error) is the kernel's to meet too.
_REFUSALS = {1: "CUDA_ERROR_INVALID_VALUE", 801: "CUDA_ERROR_NOT_SUPPORTED"}


def _stop_word_writes(index: int, code: int) -> None:
    """After the driver refused a stream memory op on GPU ``index`` with a :data:`_REFUSALS` code (nothing
    enqueued): the kernel from now on (logged once, with the error's name)."""
    with _lock:
        if _WORD_WRITES.get(index):
            _log.warning("syncless.cc: cuStreamWriteValue refused an upload on cuda:%d (%s); 4- and 8-byte uploads "
                         "there are written by the inline kernel from now on", index, _REFUSALS[code])
        _WORD_WRITES[index] = False


def functions(index: int) -> tuple[int, ...] | None:
    """The kernel entries on GPU ``index`` (loaded at the first call; None: unavailable there). Host only."""
    found = _FUNCTIONS.get(index, False)
    if found is False:
        with _lock:
            found = _FUNCTIONS.get(index, False)
            if found is False:
                found = _load(index)
                if found is _RETRY:  # out of memory at the JIT: not remembered, asked again next time
                    return None
                _FUNCTIONS[index] = found
    return found


def give_up(index: int, err: BaseException) -> None:
    """After a failed launch on GPU ``index`` (nothing enqueued): stage its small uploads from now on (logged once).

    A launch that the driver refuses (the module's context was reset under it, a stream of another context)
    must not turn a copy torch would have made into an error."""
    with _lock:
        if _FUNCTIONS.get(index) is not None:
            _log.warning("syncless.cc: an inline upload's launch failed on cuda:%d (%s); small H2D copies there are "
                         "staged from now on", index, err)
        _FUNCTIONS[index] = None


class _Block:
    """One parameter block (header and payload) and the ``extra`` array that hands it to ``cuLaunchKernel``."""

    __slots__ = ("buffer", "address", "size", "extra_address", "_keep")

    def __init__(self, payload: int) -> None:
        self.buffer = (ctypes.c_char * (_HEADER + payload))()
        self.address = ctypes.addressof(self.buffer)
        size = ctypes.c_size_t(_HEADER + payload)
        extra = (ctypes.c_void_p * 5)(_CU_LAUNCH_PARAM_BUFFER_POINTER, self.address,
                                      _CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size), _CU_LAUNCH_PARAM_END)
        self.extra_address = ctypes.addressof(extra)
        self.size = payload
        self._keep = (size, extra)


def _blocks() -> tuple[_Block, ...]:
    blocks = getattr(_local, "blocks", None)
    if blocks is None:
        blocks = _local.blocks = tuple(_Block(size) for size in PAYLOAD_SIZES)
    return blocks


_pack_header = struct.Struct("<QI").pack_into


def launch(entries: tuple[int, ...], dst_ptr: int, src_ptr: int, nbytes: int, stream_handle: int,
           index: int = -1) -> None:
    """Enqueue on ``stream_handle`` of GPU ``index`` a write of host bytes ``[src_ptr, src_ptr + nbytes)`` (read
    now) to device ``dst_ptr``: one stream memory op for 4 or 8 aligned bytes, else the kernel. GPU-side; the host
    does not block (GIL held through the call); the calling thread's current context must be the GPU's primary
    one. ``0 < nbytes <= INLINE_MAX_BYTES``."""
    if nbytes <= 8 and _WORD_WRITES.get(index):
        quick = (libcuda.LOADED[0] or libcuda.libraries())[0]
        code = -1
        if nbytes == 8 and not dst_ptr & 7:
            code = quick.cuStreamWriteValue64_v2(stream_handle, dst_ptr, _u64_at(src_ptr).value, 0)
        elif nbytes == 4 and not dst_ptr & 3:
            code = quick.cuStreamWriteValue32_v2(stream_handle, dst_ptr, _u32_at(src_ptr).value, 0)
        if code == 0:
            return
        if code in _REFUSALS:
            _stop_word_writes(index, code)  # refused, nothing enqueued: this upload and later ones take the kernel
        elif code > 0 and index not in _OTHER_FAILURES_LOGGED:
            # Another code: this upload takes the kernel, whose launch meets the same state and reports it. Said
            # once per GPU (debug), so that one that keeps coming back without failing the kernel is visible.
            _OTHER_FAILURES_LOGGED.add(index)
            _log.debug("syncless.cc: cuStreamWriteValue failed on cuda:%d (CUresult %d); that upload went to the "
                       "inline kernel", index, code)
    blocks = getattr(_local, "blocks", None) or _blocks()
    slot = 0
    while blocks[slot].size < nbytes:
        slot += 1
    block = blocks[slot]
    _pack_header(block.buffer, 0, dst_ptr, nbytes)
    ctypes.memmove(block.address + _HEADER, src_ptr, nbytes)
    grid = (nbytes + _THREADS - 1) // _THREADS
    quick = (libcuda.LOADED[0] or libcuda.libraries())[0]
    code = quick.cuLaunchKernel(entries[slot], grid, 1, 1, _THREADS, 1, 1, 0, stream_handle, None, block.extra_address)
    if code:
        libcuda.raise_for("cuLaunchKernel", code)


def forget_after_fork() -> None:
    """In a forked child: the parent's modules are not loaded there."""
    global _lock
    _lock = threading.Lock()
    _FUNCTIONS.clear()
    _WORD_WRITES.clear()
    _OTHER_FAILURES_LOGGED.clear()

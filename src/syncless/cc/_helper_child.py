"""The D2H helper process's own program: it makes the small offloaded D2H copies of one GPU for its parent.

Run by :mod:`._helper` as ``python -I -S <this file> <memfd> <wake fd> <parent pid> <libcuda>``: the Python
standard library and the CUDA driver through ``ctypes``, nothing else (no torch, no syncless import), so it
starts in a fraction of a second and holds nothing but a CUDA context. Under CC a device-to-host copy blocks
the thread that issues it until the copy is done; here that thread is this process's, so no thread of the
parent waits for the transfer and the parent's GIL is never handed over for it.

The shared memory (a ``memfd`` the parent made, :class:`Layout`) holds the parent's device ring and ready
events as IPC handles, a ring of posted jobs, a done word per slot and the host staging. Per job::

    parent D : ... src -> ring[slot] (D2D)  R[slot] ; post(seq, slot, n)
    here     :   (R[slot] fired?) ring[slot] -> staging[slot] (D2H on this process's stream) ; sync ; done[slot]=seq
    parent   : (at the covering wait) done[slot] == seq ? -> staging[slot] -> destination (memmove)

A job is copied once its ready event has fired (``cuEventQuery``, on the host: nothing of this process ever
waits on the GPU for the parent's work, so its channels never sit in the GPU's scheduler behind the parent's),
in whatever order their events fire: a slow producer on one D2H stream holds up no other stream's copies.

Words are 8 bytes and aligned, each written whole (one store): a post is ``seq << 25 | slot << 17 | nbytes``,
a done word ``seq << 12 | CUresult`` (4095: a failure without a driver code). A reader trusts a post only when
its sequence number is the one it expects, so a torn or early read is never taken for a job. :func:`fence`
orders this process's stores and loads around them on CPUs that reorder (ARM); on x86 it costs a lock cycle.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import select
import sys
import threading
import time

MAGIC = 0x73796E636C657373  # "syncless"
# Header words (8 bytes each)
W_MAGIC, W_STATE, W_SLEEPING, W_STOP, W_SLOTS, W_SLOT_BYTES, W_CHILD_PID, W_PROCESSED = range(8)
STATE_STARTING, STATE_READY, STATE_FAILED, STATE_EXITED = 0, 1, 2, 3
BUS_ID_AT, MEM_HANDLE_AT, ERROR_AT, ERROR_BYTES = 64, 128, 256, 2048
HANDLE_BYTES = 64
EVENTS_AT = 4096
NO_DRIVER_CODE = 4095  # a done word's code for a failure that has no CUresult
CUDA_ERROR_NOT_READY = 600
SPIN_S = 0.0002  # how long the loop polls with nothing to do before it sleeps on the wake pipe
QUERY_EVERY_S = 20e-6  # the pause between two looks at a job's ready event (bounds the driver calls made waiting)
PARENT_CHECK_S = 0.5  # how often a loop waiting on ready events asks whether the parent still lives
SLEEP_S = 0.005  # the longest it sleeps before looking again (a lost wake costs at most this)

_fence_lock = threading.Lock()


# Whether this CPU makes a thread's stores visible to other processes in program order (x86-64's total store
# order): then a store needs no fence after an earlier one, only before a later load (Arm, e.g. Grace, does not).
STORES_IN_ORDER = platform.machine() in ("x86_64", "AMD64")


def fence() -> None:
    """A full memory barrier between the loads and stores before and after it (a lock's release then acquire)."""
    _fence_lock.acquire()
    _fence_lock.release()
    _fence_lock.acquire()
    _fence_lock.release()


class Layout:
    """Where everything sits in the shared memory of a helper with ``slots`` slots of ``slot_bytes`` each."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.posts_at = EVENTS_AT + slots * HANDLE_BYTES
        self.done_at = self.posts_at + 8 * slots
        page = mmap.PAGESIZE
        self.staging_at = (self.done_at + 8 * slots + page - 1) // page * page
        self.size = self.staging_at + slots * slot_bytes


def pack_post(seq: int, slot: int, nbytes: int) -> int:
    return seq << 25 | slot << 17 | nbytes


def unpack_post(word: int) -> tuple[int, int, int]:
    return word >> 25, (word >> 17) & 0xFF, word & 0x1FFFF


def pack_done(seq: int, code: int) -> int:
    return seq << 12 | min(code, NO_DRIVER_CODE)


def write_error(buf: memoryview, text: str) -> None:
    data = text.encode("utf-8", "replace")[:ERROR_BYTES - 1]
    buf[ERROR_AT:ERROR_AT + len(data)] = data
    buf[ERROR_AT + len(data)] = 0


def read_error(buf: memoryview) -> str:
    raw = bytes(buf[ERROR_AT:ERROR_AT + ERROR_BYTES])
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class Driver:
    """The driver calls this process makes (``ctypes``; the GIL is irrelevant here: one thread)."""

    def __init__(self, libcuda: str) -> None:
        self.lib = lib = ctypes.CDLL(libcuda)
        for name in ("cuInit", "cuDeviceGetByPCIBusId", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
                     "cuIpcOpenMemHandle_v2", "cuIpcOpenEventHandle", "cuMemHostRegister_v2", "cuMemAllocHost_v2",
                     "cuStreamCreate", "cuEventQuery", "cuMemcpyDtoHAsync_v2", "cuStreamSynchronize",
                     "cuGetErrorString"):
            getattr(lib, name).restype = ctypes.c_int
        lib.cuEventQuery.argtypes = (ctypes.c_void_p,)
        lib.cuMemcpyDtoHAsync_v2.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
        lib.cuStreamSynchronize.argtypes = (ctypes.c_void_p,)
        self.stream = None

    def check(self, name: str, code: int) -> None:
        if code:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise RuntimeError(f"{name} failed: CUresult {code} ({(text.value or b'?').decode()})")

    def open(self, buf: memoryview, layout: Layout, staging_address: int) -> tuple[int, list[int], int]:
        """Make the GPU's primary context current, open the parent's ring and events, register the staging.

        Returns ``(ring device pointer, event handles, address the copies land at)``: the staging itself when the
        driver pins it, else a pinned buffer of this process's (each copy then moved into the staging after it).
        """
        lib = self.lib
        self.check("cuInit", lib.cuInit(0))
        bus_id = bytes(buf[BUS_ID_AT:BUS_ID_AT + 32]).split(b"\0", 1)[0]
        device = ctypes.c_int()
        self.check("cuDeviceGetByPCIBusId", lib.cuDeviceGetByPCIBusId(ctypes.byref(device), bus_id))
        context = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
        self.check("cuCtxSetCurrent", lib.cuCtxSetCurrent(context))
        ring = ctypes.c_uint64()
        # (a 64-byte struct passed by value: declared as one, so ctypes passes it as the ABI says)
        lib.cuIpcOpenMemHandle_v2.argtypes = (ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint)
        lib.cuIpcOpenEventHandle.argtypes = (ctypes.POINTER(ctypes.c_void_p), _Handle)
        self.check("cuIpcOpenMemHandle", lib.cuIpcOpenMemHandle_v2(
            ctypes.byref(ring), _handle(buf, MEM_HANDLE_AT), 1))
        events = []
        for slot in range(layout.slots):
            at = EVENTS_AT + slot * HANDLE_BYTES
            event = ctypes.c_void_p()
            self.check("cuIpcOpenEventHandle",
                       lib.cuIpcOpenEventHandle(ctypes.byref(event), _handle(buf, at)))
            events.append(event.value)
        stream = ctypes.c_void_p()
        self.check("cuStreamCreate", lib.cuStreamCreate(ctypes.byref(stream), 1))  # non-blocking: no null stream
        self.stream = stream.value
        size = layout.slots * layout.slot_bytes
        lib.cuMemHostRegister_v2.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
        if lib.cuMemHostRegister_v2(staging_address, size, 0) == 0:
            return ring.value, events, staging_address
        bounce = ctypes.c_void_p()
        lib.cuMemAllocHost_v2.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
        self.check("cuMemAllocHost", lib.cuMemAllocHost_v2(ctypes.byref(bounce), size))
        return ring.value, events, bounce.value

    def query(self, event: int) -> int:
        return self.lib.cuEventQuery(event)

    def copy_to_host(self, host: int, device: int, nbytes: int) -> int:
        """Copy and wait for it (under CC the copy itself blocks until done); the first failing CUresult, or 0."""
        code = self.lib.cuMemcpyDtoHAsync_v2(host, device, nbytes, self.stream) if nbytes else 0
        sync = self.lib.cuStreamSynchronize(self.stream)
        return code or sync


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


def _handle(buf: memoryview, at: int) -> _Handle:
    """The IPC handle stored at ``at``, all 64 bytes (a ``c_char`` array's setter would stop at the first NUL)."""
    return _Handle.from_buffer_copy(bytes(buf[at:at + HANDLE_BYTES]))


def serve(driver, buf: memoryview, words: memoryview, layout: Layout, ring: int, events: list[int],
          landing: int, staging: int, parent: int, wake_fd: int | None) -> None:
    """Copy posted jobs until the parent sets the stop word (or dies); publish each one's done word.

    ``landing`` is where the driver copies a slot's bytes (``staging`` itself, or a pinned bounce buffer whose
    bytes are then moved into ``staging``). Jobs are taken in post order and copied in the order their ready
    events fire.
    """
    slots, slot_bytes = layout.slots, layout.slot_bytes
    posts, done = layout.posts_at // 8, layout.done_at // 8
    expected = 1
    pending: list[tuple[int, int, int]] = []  # (seq, slot, nbytes), in post order
    idle_since = time.monotonic()
    while True:
        while True:  # every new post, in order
            seq, slot, nbytes = unpack_post(words[posts + expected % slots])
            if seq != expected:
                break
            pending.append((seq, slot, nbytes))
            expected += 1
        if pending:
            fence()  # the parent recorded each job's event before posting it
            progressed = False
            for job in list(pending):
                seq, slot, nbytes = job
                code = driver.query(events[slot])
                if code == CUDA_ERROR_NOT_READY:
                    continue
                if code == 0:
                    code = driver.copy_to_host(landing + slot * slot_bytes, ring + slot * slot_bytes, nbytes)
                    if code == 0 and landing != staging and nbytes:
                        ctypes.memmove(staging + slot * slot_bytes, landing + slot * slot_bytes, nbytes)
                fence()  # the bytes before the word that says they are there
                words[done + slot] = pack_done(seq, code)
                words[W_PROCESSED] = words[W_PROCESSED] + 1
                pending.remove(job)
                progressed = True
            if progressed:
                idle_since = time.monotonic()
            else:  # nothing fired yet: wait a moment before asking the driver again (no syscall, no driver call)
                until = time.perf_counter() + QUERY_EVERY_S
                while time.perf_counter() < until:
                    pass
                if time.monotonic() - idle_since > PARENT_CHECK_S:
                    if os.getppid() != parent:
                        return  # the parent died with copies posted: nobody waits for them
                    idle_since = time.monotonic()
            continue
        if words[W_STOP]:
            return
        if time.monotonic() - idle_since < SPIN_S:
            continue
        if os.getppid() != parent:
            return  # the parent is gone: nothing here is anyone's any more
        words[W_SLEEPING] = 1
        fence()
        if unpack_post(words[posts + expected % slots])[0] != expected and not words[W_STOP]:
            if wake_fd is None:
                time.sleep(SLEEP_S)
            else:
                ready, _, _ = select.select([wake_fd], [], [], SLEEP_S)
                if ready:
                    try:
                        if not os.read(wake_fd, 4096):
                            return  # end of file: every holder of the pipe's write end, the parent first, is gone
                    except BlockingIOError:
                        pass
        words[W_SLEEPING] = 0
        idle_since = time.monotonic()


def main(argv: list[str]) -> int:
    memfd, wake_fd, parent, libcuda = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    # (No PR_SET_PDEATHSIG: Linux sends it when the *thread* that started this process ends, and the parent's
    # thread that starts a helper may be any short-lived one. The loop checks the parent instead.)
    if os.getppid() != parent:
        return 1
    os.set_blocking(wake_fd, False)
    shared = mmap.mmap(memfd, 0)
    buf = memoryview(shared)
    words = buf.cast("Q")
    if words[W_MAGIC] != MAGIC:
        return 2
    layout = Layout(words[W_SLOTS], words[W_SLOT_BYTES])
    words[W_CHILD_PID] = os.getpid()
    base = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    staging = base + layout.staging_at
    try:
        driver = Driver(libcuda)
        ring, events, landing = driver.open(buf, layout, staging)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which copies in its own process instead
        write_error(buf, f"{type(err).__name__}: {err}")
        fence()
        words[W_STATE] = STATE_FAILED
        return 3
    fence()
    words[W_STATE] = STATE_READY
    try:
        serve(driver, buf, words, layout, ring, events, landing, staging, parent, wake_fd)
    finally:
        words[W_STATE] = STATE_EXITED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

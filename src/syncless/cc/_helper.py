"""The D2H helper process (``SYNCLESS_CC_D2H_HELPER=1``): small offloaded readbacks copied by another process.

Under CC a D2H copy blocks the thread that issues it until the copy is done. In this process that thread
either is the caller (the decode loop pays the transfer, about 27 us a step on an H200 when emulated) or a
worker thread, which must take the GIL after each driver call while the loop runs Python (a switch each time,
issue 33). A process of its own has a GIL of its own: the helper (:mod:`._helper_child`) issues the copy and
waits for it, and the loop's only costs are enqueueing a device copy and an event record, and, at the covering
wait a step later, one ``memmove`` of the bytes out of shared memory.

One helper per GPU, started at the first D2H stream (or offload) while the shim is installed with the option
on. It takes ``.to("cpu", non_blocking=True)`` of one contiguous block of at most :data:`SLOT_BYTES` (the lane,
:mod:`._fast`); anything else, and everything while the helper is starting, full or gone, is offloaded in this
process as before. Per copy, on the caller's thread::

    D      : ... src -> ring[slot] (D2D, raw)  R[slot]            (both enqueued; the host does not block)
    host   : post(seq, slot, n) to the helper ; submit the job to D's queue (:mod:`._worker`)
    helper : R[slot] fired -> ring[slot] -> staging[slot] ; done[slot] = seq
    waiter : (the job, at the covering wait) done[slot] == seq -> memmove staging[slot] -> destination

The job counts as finished only after the ``memmove``, so every ordering argument of :mod:`._d2h` holds as for
a job run in this process. The ring slot is written again only after its done word said the helper's copy of it
is over (the slot goes back to the free list after the ``memmove``), so no copy reads a slot a later snapshot is
writing; the slot's event is recorded again only then too.

What it costs: a CUDA context in the helper (a few hundred MiB of GPU memory), one CPU core while copies come
faster than every few milliseconds (it polls; it sleeps on a pipe after :data:`._helper_child.SPIN_S` idle), and
``SLOTS * SLOT_BYTES`` of device memory and of shared host memory. If the helper cannot start (no CUDA IPC, a
GPU hidden from it), a warning says why once and copies stay in this process. If it dies, each copy it had not
made fails with :class:`D2HHelperGoneError` (a ``D2HCopyError`` at the covering wait, as any failed copy) and
later copies stay in this process.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import os
import subprocess
import sys
import threading
import time
from typing import Any

from syncless._core import libcuda
from syncless._core.errors import CudaError, MissingDependencyError, SynclessError
from syncless.cc import _helper_child as child
from syncless.cc import _raw

_log = logging.getLogger(__name__)

SLOTS = 128
SLOT_BYTES = 64 * 1024  # the largest readback the helper takes (a batch's tokens, logprobs of a few rows)
_CU_EVENT_DISABLE_TIMING, _CU_EVENT_INTERPROCESS = 2, 4
_SPIN_WAIT_S = 200e-6  # how long a waiter spins on a done word (GIL held) before it sleeps between looks
_CHECK_ALIVE_S = 0.01  # how often a waiter that found its copy not yet made asks whether the helper lives

ENABLED = [False]  # SYNCLESS_CC_D2H_HELPER, set by install_shim()


class D2HHelperGoneError(SynclessError, RuntimeError):
    """The D2H helper process exited before it made a copy: the copy's destination was not written."""


class _Channel:
    """The shared memory between this process and one helper, and the protocol on it (no CUDA here).

    Posts are made under the caller's lock (:data:`._d2h._offload_lock`), so they are numbered in order; done
    words are read lock-free (one aligned 8-byte load each).
    """

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        if not 1 <= slots <= 256 or not 0 < slot_bytes <= 1 << 16:
            raise ValueError(f"a helper holds 1-256 slots of at most 64 KiB, not {slots} of {slot_bytes} bytes")
        self.layout = layout = child.Layout(slots, slot_bytes)
        self.fd = os.memfd_create("syncless-d2h-helper", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, layout.size)
        self.shared = mmap.mmap(self.fd, layout.size)
        self.buf = memoryview(self.shared)
        self.words = self.buf.cast("Q")
        self.words[child.W_MAGIC] = child.MAGIC
        self.words[child.W_SLOTS] = slots
        self.words[child.W_SLOT_BYTES] = slot_bytes
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.shared))
        self.staging = self.base + layout.staging_at
        self.slot_bytes = slot_bytes
        self._posts, self._done = layout.posts_at // 8, layout.done_at // 8
        self.free = list(range(slots - 1, -1, -1))  # pop() takes slot 0 first
        # The copy each slot holds (its sequence number; 0: none). A slot goes back to ``free`` only by the delivery
        # or failure of the copy it holds, once: a job run again after an interrupt finds it delivered.
        self.owner = [0] * slots
        self.last_seq = 0
        self.wake_fd: int | None = None
        self.alive = lambda: True  # replaced by the process's check

    def take_slot(self) -> int | None:
        """A free slot, or None (every slot holds a copy not yet delivered)."""
        try:
            return self.free.pop()
        except IndexError:
            return None

    def post(self, slot: int, nbytes: int) -> int:
        """Hand the helper the copy of ``nbytes`` in ``slot`` (its ready event is recorded); return its number."""
        seq = self.last_seq + 1
        self.last_seq = seq
        self.owner[slot] = seq
        if not child.STORES_IN_ORDER:
            child.fence()  # the event record before the post that names it (x86-64 keeps stores in order)
        self.words[self._posts + seq % self.layout.slots] = child.pack_post(seq, slot, nbytes)
        child.fence()  # the post before the look at the sleeping word (the helper stores that, then looks for posts)
        if self.words[child.W_SLEEPING]:
            self.wake()
        return seq

    def wake(self) -> None:
        if self.wake_fd is not None:
            try:
                os.write(self.wake_fd, b"w")
            except (BlockingIOError, OSError):
                pass  # the pipe is full (the helper is awake) or closed (it is gone)

    def is_done(self, slot: int, seq: int) -> bool:
        return self.words[self._done + slot] >> 12 == seq

    def wait(self, slot: int, seq: int) -> int:
        """Block until the helper has made copy ``seq`` of ``slot``; return its CUresult (0: the bytes are there).

        Polls the done word (a spin of up to :data:`_SPIN_WAIT_S`, then short sleeps that release the GIL), and every
        :data:`_CHECK_ALIVE_S` asks whether the helper still runs. Raises :class:`D2HHelperGoneError` if not.
        """
        words, at = self.words, self._done + slot
        spin_until = time.perf_counter() + _SPIN_WAIT_S
        check_at = time.monotonic() + _CHECK_ALIVE_S
        while (word := words[at]) >> 12 != seq:
            if time.perf_counter() < spin_until:
                continue  # (a sleep costs 50 us or more of timer slack: more than most copies have left)
            if words[child.W_SLEEPING]:
                self.wake()
            time.sleep(20e-6)
            now = time.monotonic()
            if now >= check_at:
                check_at = now + _CHECK_ALIVE_S
                if not self.alive() and words[at] >> 12 != seq:
                    raise D2HHelperGoneError(self.gone_text(seq))
        child.fence()  # the done word before the bytes it vouches for
        return word & 0xFFF

    def gone_text(self, seq: int) -> str:
        return (f"the syncless D2H helper process exited before it made copy #{seq}; the copy's destination was not "
                "written. Copies are made in this process from now on; see the log for the helper's exit")

    def deliver(self, slot: int, seq: int, dst_ptr: int, nbytes: int) -> None:
        """Wait for copy ``seq`` of ``slot``, move its bytes to host address ``dst_ptr``, free the slot.

        Raises :class:`CudaError` with the helper's driver result if its copy failed, or
        :class:`D2HHelperGoneError`; either way the slot is kept out of use (its device write may still be queued).
        Called again for a copy already delivered (a job run again after an interrupt), does nothing.
        """
        if self.owner[slot] != seq:
            return  # delivered (or failed) already: the slot may hold a newer copy now
        word = self.words[self._done + slot]
        if word >> 12 == seq:  # made already (the common case: read a step late)
            child.fence()  # the done word before the bytes it vouches for
            code = word & 0xFFF
        else:
            code = self.wait(slot, seq)
        if code:
            self.owner[slot] = -1  # kept out: the parent's device write into it may still be queued
            call = "cuMemcpyDtoHAsync (in the D2H helper process)"
            if code != child.NO_DRIVER_CODE:
                try:
                    libcuda.raise_for(call, code)  # named by the driver
                except MissingDependencyError:
                    pass
            raise CudaError(call, code, f"CUresult {code}", "the helper's copy failed")
        if nbytes:
            ctypes.memmove(dst_ptr, self.staging + slot * self.slot_bytes, nbytes)
        self.owner[slot] = 0
        self.free.append(slot)

    def all_delivered(self) -> bool:
        """Whether no posted copy waits for its delivery (nothing will touch the shared memory or the ring)."""
        return not any(owner > 0 for owner in self.owner)

    def close_channel(self) -> None:
        """Release the shared memory and the wake pipe, if no copy waits for its delivery (else they are kept for
        the process's life: a waiter may still read them). Host only."""
        if not self.all_delivered():
            return
        if self.wake_fd is not None:
            fd, self.wake_fd = self.wake_fd, None
            os.close(fd)
        self.words.release()
        self.buf.release()
        self.shared.close()
        os.close(self.fd)


class D2HHelper(_Channel):
    """The helper of GPU ``index``: its CUDA resources here (the ring, the IPC events), the channel, the process."""

    def __init__(self, index: int, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        super().__init__(slots, slot_bytes)
        self.index = index
        self.usable = False  # read by the lane at each readback: True once the helper said it is ready
        self.failed = False  # it could not start, or it is gone: never used again
        self.process: subprocess.Popen | None = None
        self.ring, self.events = 0, []
        try:
            _make_cuda_resources(index, self)
            self._start()
        except BaseException:
            self._release_cuda_resources()
            self.close_channel()  # nothing was posted: all of it goes
            raise

    def _start(self) -> None:
        read_fd, self.wake_fd = os.pipe()
        os.set_blocking(self.wake_fd, False)
        argv = [sys.executable, "-I", "-S", child.__file__, str(self.fd), str(read_fd), str(os.getpid()),
                libcuda.LOADED_FROM[0] or "libcuda.so.1"]
        try:
            self.process = subprocess.Popen(argv, pass_fds=(self.fd, read_fd), stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL)
        finally:
            os.close(read_fd)
        process = self.process
        self.alive = lambda: process.poll() is None

    def _release_cuda_resources(self) -> None:
        """Free the ring and destroy the events (only once no copy can touch them: nothing posted, or all
        delivered and the helper gone). Errors are logged: this runs on the way out."""
        if not self.ring and not self.events:
            return
        quick = libcuda.libraries()[0]
        try:
            with _raw.InContext(self.index):
                for event in self.events:
                    quick.cuEventDestroy_v2(event)
                if self.ring:
                    quick.cuMemFree_v2(self.ring)
        except Exception as err:  # noqa: BLE001 - a release that fails loses memory, not data
            _log.warning("syncless.cc: the D2H helper's device ring and events of cuda:%d were not released (%s)",
                         self.index, err)
        self.events, self.ring = [], 0

    def ring_ptr(self, slot: int) -> int:
        return self.ring + slot * self.slot_bytes

    def is_usable(self) -> bool:
        """Whether copies may go to the helper now (it said it is ready, and lives). Cheap once ready."""
        if self.usable:
            return True
        if self.failed:
            return False
        state = self.words[child.W_STATE]
        if state == child.STATE_READY:
            child.fence()
            self.usable = True
            return True
        if state == child.STATE_FAILED or not self.alive():
            child.fence()  # the state word before the error text it vouches for
            why = child.read_error(self.buf) if state == child.STATE_FAILED else (
                f"it exited with code {self.process.poll()} while starting")
            _log.warning("syncless.cc: the D2H helper process for cuda:%d could not start (%s); small D2H copies "
                         "stay in this process", self.index, why)
            self.failed = True
        return False

    def mark_gone(self) -> None:
        if not self.failed:
            self.failed, self.usable = True, False
            _log.warning("syncless.cc: the D2H helper process for cuda:%d (pid %s) exited (code %s); copies it had "
                         "not made fail with D2HHelperGoneError, later ones are made in this process", self.index,
                         self.process.pid if self.process else "?", self.process.poll() if self.process else "?")

    def wait(self, slot: int, seq: int) -> int:
        try:
            return super().wait(slot, seq)
        except D2HHelperGoneError:
            self.mark_gone()
            raise

    def gone_text(self, seq: int) -> str:
        code = self.process.poll() if self.process else None
        said = child.read_error(self.buf)
        return (f"the syncless D2H helper process of cuda:{self.index} (pid {self.process.pid if self.process else '?'}"
                f", exit code {code}{'; it said: ' + said if said else ''}) exited before it made copy #{seq}; the "
                "copy's destination was not written. Later copies are made in this process; set "
                "SYNCLESS_CC_D2H_HELPER=0 to keep them there (a negative exit code is the signal that ended it)")

    def stop(self, timeout_s: float = 2.0) -> None:
        """Ask the helper to finish its copies and exit (at most ``timeout_s``, then kill it); blocks the host."""
        self.usable = False
        self.failed = True
        self.words[child.W_STOP] = 1
        self.wake()
        process = self.process
        if process is not None and process.poll() is None:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout_s)
        if self.all_delivered():  # the helper is gone and no waiter needs anything: release it all
            self._release_cuda_resources()
            self.close_channel()


def _make_cuda_resources(index: int, channel: D2HHelper) -> None:
    """Allocate the device ring and the interprocess ready events on GPU ``index`` (``channel.ring``,
    ``channel.events``) and write their IPC handles, and the GPU's PCI bus id, into ``channel``'s header. Host only
    (a ``cuMemAlloc``, ``slots`` event creations)."""
    quick = libcuda.libraries()[0]
    layout = channel.layout

    def ok(name: str, code: int) -> None:
        if code:
            libcuda.raise_for(name, code)

    with _raw.InContext(index):  # (what it made is on ``channel`` as it goes, so a failure part-way releases it)
        device = ctypes.c_int()
        ok("cuDeviceGet", quick.cuDeviceGet(ctypes.byref(device), index))
        bus_id = ctypes.create_string_buffer(32)
        ok("cuDeviceGetPCIBusId", quick.cuDeviceGetPCIBusId(bus_id, 32, device))
        channel.buf[child.BUS_ID_AT:child.BUS_ID_AT + 32] = bus_id.raw
        ring = ctypes.c_uint64()
        ok("cuMemAlloc", quick.cuMemAlloc_v2(ctypes.byref(ring), layout.slots * layout.slot_bytes))
        channel.ring = ring.value
        handle = ctypes.create_string_buffer(child.HANDLE_BYTES)
        ok("cuIpcGetMemHandle", quick.cuIpcGetMemHandle(handle, ring))
        channel.buf[child.MEM_HANDLE_AT:child.MEM_HANDLE_AT + child.HANDLE_BYTES] = handle.raw
        for slot in range(layout.slots):
            event = ctypes.c_void_p()
            ok("cuEventCreate", quick.cuEventCreate(ctypes.byref(event),
                                                     _CU_EVENT_DISABLE_TIMING | _CU_EVENT_INTERPROCESS))
            channel.events.append(event.value)
            ok("cuIpcGetEventHandle", quick.cuIpcGetEventHandle(handle, event))
            at = child.EVENTS_AT + slot * child.HANDLE_BYTES
            channel.buf[at:at + child.HANDLE_BYTES] = handle.raw


_lock = threading.Lock()
_HELPERS: dict[int, D2HHelper | None] = {}  # GPU index -> its helper (None: it could not be made; not retried)


def for_device(index: int) -> D2HHelper | None:
    """GPU ``index``'s helper if copies may go to it now, else None; starts it (without waiting) the first time.

    A dict lookup and an attribute read once the helper is ready.
    """
    helper = _HELPERS.get(index)
    if helper is not None:
        return helper if helper.usable or helper.is_usable() else None
    if not ENABLED[0] or index in _HELPERS:
        return None
    start(index)
    return None


def start(index: int) -> None:
    """Start GPU ``index``'s helper if the option is on and it has none (does not wait for it to be ready)."""
    with _lock:
        if not ENABLED[0] or index in _HELPERS:
            return
        try:
            _HELPERS[index] = D2HHelper(index)
        except Exception as err:  # noqa: BLE001 - no helper is no error: the copies stay in this process
            _HELPERS[index] = None
            _log.warning("syncless.cc: no D2H helper process for cuda:%d (%s: %s); small D2H copies stay in this "
                         "process", index, type(err).__name__, err)


def wait_ready(index: int, timeout_s: float = 30.0) -> bool:
    """Start GPU ``index``'s helper if it has none, and block the host until it is ready (at most ``timeout_s``);
    return whether copies go to it now (False: the option is off, or it could not start: the log says why)."""
    start(index)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        helper = _HELPERS.get(index)
        if helper is None:
            return False
        if helper.is_usable():
            return True
        if helper.failed:
            return False
        time.sleep(0.002)
    return False


def stop_all(timeout_s: float = 2.0) -> None:
    """Stop every helper (``uninstall()``, exit): each finishes the copies it was handed, then exits. The next
    :func:`start` makes a new one."""
    with _lock:
        helpers = [h for h in _HELPERS.values() if h is not None]
        _HELPERS.clear()
    for helper in helpers:
        helper.stop(timeout_s)


def forget_after_fork() -> None:
    """In a forked child: the parent's helpers are not this process's (their shared memory is the parent's)."""
    global _lock
    _lock = threading.Lock()
    for helper in _HELPERS.values():
        if helper is not None:
            helper.usable, helper.failed = False, True
            for fd in (helper.wake_fd, helper.fd):  # (the mapping stays: a memoryview of it may be held)
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            helper.wake_fd = None
    _HELPERS.clear()


atexit.register(stop_all)

"""The D2H helper process's protocol without a GPU: the child's serve loop against a fake driver, and the real
child program started with a library that is not a CUDA driver (it must report why it cannot start)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest

from syncless._core import config
from syncless._core.errors import CudaError
from syncless.cc import _helper
from syncless.cc import _helper_child as child

SLOTS, SLOT_BYTES = 8, 256


class _FakeDriver:
    """Stands in for the CUDA driver in the child: events fire when the test says, copies are memmoves."""

    def __init__(self, slots: int):
        self.fired = [False] * slots
        self.failing: set[int] = set()  # slots whose next copy fails
        self.copied: list[int] = []  # slots, in the order their copies were made

    def query(self, event: int) -> int:
        return 0 if self.fired[event] else child.CUDA_ERROR_NOT_READY

    def copy_to_host(self, host: int, device: int, nbytes: int) -> int:
        slot = (device - _FakeDriver.ring_base) // SLOT_BYTES
        self.copied.append(slot)
        if slot in self.failing:
            self.failing.discard(slot)
            return 719  # CUDA_ERROR_LAUNCH_FAILED
        ctypes.memmove(host, device, nbytes)
        return 0


@pytest.fixture
def served():
    """A channel and the child's serve loop in a thread of this process over the same shared memory."""
    channel = _helper._Channel(SLOTS, SLOT_BYTES)
    device = ctypes.create_string_buffer(SLOTS * SLOT_BYTES)
    _FakeDriver.ring_base = ctypes.addressof(device)
    driver = _FakeDriver(SLOTS)
    thread = threading.Thread(target=child.serve, daemon=True, args=(
        driver, channel.buf, channel.words, channel.layout, ctypes.addressof(device), list(range(SLOTS)),
        channel.staging, channel.staging, os.getppid(), None))
    thread.start()
    yield channel, device, driver
    channel.words[child.W_STOP] = 1
    thread.join(5)
    assert not thread.is_alive(), "the serve loop did not stop on the stop word"


def _post(channel, device, driver, payload: bytes, fire: bool = True) -> tuple[int, int]:
    slot = channel.take_slot()
    ctypes.memmove(ctypes.addressof(device) + slot * SLOT_BYTES, payload, len(payload))
    driver.fired[slot] = fire
    return slot, channel.post(slot, len(payload))


def test_posted_copies_are_delivered_bit_exact(served):
    channel, device, driver = served
    for round_ in range(50):
        payloads = [os.urandom(1 + (round_ * 37 + k) % SLOT_BYTES) for k in range(3)]
        posted = [_post(channel, device, driver, p) for p in payloads]
        for (slot, seq), payload in zip(posted, payloads):
            out = ctypes.create_string_buffer(len(payload))
            channel.deliver(slot, seq, ctypes.addressof(out), len(payload))
            assert out.raw == payload
    assert len(channel.free) == SLOTS, "a delivered slot was not freed"


def test_a_copy_whose_event_fires_later_holds_up_no_other(served):
    channel, device, driver = served
    slow = _post(channel, device, driver, b"slow", fire=False)
    fast = _post(channel, device, driver, b"fast")
    out = ctypes.create_string_buffer(4)
    channel.deliver(*fast, ctypes.addressof(out), 4)
    assert out.raw == b"fast"
    assert not channel.is_done(*slow), "a copy was made before its ready event fired"
    driver.fired[slow[0]] = True
    channel.deliver(*slow, ctypes.addressof(out), 4)
    assert out.raw == b"slow"


def test_a_failed_copy_raises_the_drivers_error_and_writes_nothing(served):
    channel, device, driver = served
    driver.failing.add(channel.free[-1])
    slot, seq = _post(channel, device, driver, b"doomed")
    out = ctypes.create_string_buffer(b"untouched")
    with pytest.raises(CudaError, match="helper"):
        channel.deliver(slot, seq, ctypes.addressof(out), 6)
    assert out.raw[:9] == b"untouched"


def test_a_sleeping_helper_is_woken_by_a_post(served):
    channel, device, driver = served
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    channel.wake_fd = write_fd
    deadline = time.monotonic() + 2
    while not channel.words[child.W_SLEEPING] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert channel.words[child.W_SLEEPING], "an idle serve loop never went to sleep"
    slot, seq = _post(channel, device, driver, b"wake")
    assert os.read(read_fd, 16) == b"w", "a post to a sleeping helper did not write its wake pipe"
    out = ctypes.create_string_buffer(4)
    channel.deliver(slot, seq, ctypes.addressof(out), 4)  # (the fake loop sleeps at most SLEEP_S, no pipe)
    assert out.raw == b"wake"
    os.close(read_fd)
    os.close(write_fd)


def test_a_waiter_on_a_dead_helper_raises_instead_of_hanging():
    channel = _helper._Channel(SLOTS, SLOT_BYTES)
    channel.alive = lambda: False
    slot = channel.take_slot()
    seq = channel.post(slot, 8)
    started = time.monotonic()
    with pytest.raises(_helper.D2HHelperGoneError, match="not written"):
        channel.deliver(slot, seq, 0, 8)
    assert time.monotonic() - started < 1.0


def test_post_words_carry_sequence_slot_and_size():
    word = child.pack_post(123456, 255, 65536)
    assert child.unpack_post(word) == (123456, 255, 65536)
    assert child.pack_done(7, 10_000) & 0xFFF == child.NO_DRIVER_CODE


def test_the_child_program_reports_a_library_that_is_not_a_driver(tmp_path):
    """The real child, started as the shim starts it, with libc for libcuda: it must say STATE_FAILED and why."""
    channel = _helper._Channel(SLOTS, SLOT_BYTES)
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-I", "-S", child.__file__, str(channel.fd), str(read_fd), str(os.getpid()), "libc.so.6"]
    process = subprocess.run(argv, pass_fds=(channel.fd, read_fd), timeout=30, capture_output=True)
    os.close(read_fd)
    os.close(write_fd)
    assert process.returncode == 3, process.stderr
    assert channel.words[child.W_STATE] == child.STATE_FAILED
    assert "cuInit" in child.read_error(channel.buf)


def test_the_option_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv("SYNCLESS_CC_D2H_HELPER", raising=False)
    assert config.resolve("SYNCLESS_CC_D2H_HELPER") is False
    monkeypatch.setenv("SYNCLESS_CC_D2H_HELPER", "on")
    assert config.resolve("SYNCLESS_CC_D2H_HELPER") is True
    monkeypatch.setenv("SYNCLESS_CC_D2H_HELPER", "maybe")
    with pytest.raises(config.ConfigError, match="SYNCLESS_CC_D2H_HELPER"):
        config.resolve("SYNCLESS_CC_D2H_HELPER")


def test_no_helper_is_started_while_the_option_is_off(monkeypatch):
    monkeypatch.setattr(_helper, "ENABLED", [False])
    assert _helper.for_device(0) is None
    assert 0 not in _helper._HELPERS


def test_a_delivery_run_again_after_an_interrupt_frees_its_slot_once(served):
    """A job run again from its start (an interrupt after its delivery) must not free the slot a second time: two
    later copies would then share one slot."""
    channel, device, driver = served
    slot, seq = _post(channel, device, driver, b"once")
    out = ctypes.create_string_buffer(4)
    channel.deliver(slot, seq, ctypes.addressof(out), 4)
    channel.deliver(slot, seq, ctypes.addressof(out), 4)
    assert channel.free.count(slot) == 1
    again = _post(channel, device, driver, b"next")
    assert again[0] == slot  # reused once, by the next copy only
    channel.deliver(slot, seq, ctypes.addressof(out), 4)  # the old job once more: must not touch the new copy
    assert channel.owner[slot] == again[1] and slot not in channel.free


def test_a_failed_copy_keeps_its_slot_out_of_use(served):
    channel, device, driver = served
    driver.failing.add(channel.free[-1])
    slot, seq = _post(channel, device, driver, b"doomed")
    with pytest.raises(CudaError):
        channel.deliver(slot, seq, 0, 6)
    assert slot not in channel.free, "a failed copy's slot (its device write may be queued) was handed out again"
    assert channel.all_delivered()


def test_the_serve_loop_ends_when_the_parent_end_of_its_pipe_closes():
    """The helper's parent check: every holder of the wake pipe's write end gone (the parent died) ends the loop
    even while its parent pid still reads the same (a reparenting that has not happened yet)."""
    channel = _helper._Channel(SLOTS, SLOT_BYTES)
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    device = ctypes.create_string_buffer(SLOTS * SLOT_BYTES)
    thread = threading.Thread(target=child.serve, daemon=True, args=(
        _FakeDriver(SLOTS), channel.buf, channel.words, channel.layout, ctypes.addressof(device),
        list(range(SLOTS)), channel.staging, channel.staging, os.getppid(), read_fd))
    thread.start()
    deadline = time.monotonic() + 2
    while not channel.words[child.W_SLEEPING] and time.monotonic() < deadline:
        time.sleep(0.001)
    os.close(write_fd)
    thread.join(2)
    assert not thread.is_alive(), "the serve loop outlived the write end of its wake pipe"
    os.close(read_fd)


def test_close_channel_releases_the_shared_memory_once_everything_is_delivered():
    channel = _helper._Channel(SLOTS, SLOT_BYTES)
    slot = channel.take_slot()
    channel.post(slot, 8)
    channel.close_channel()  # a copy still waits for its delivery: kept
    assert channel.words[child.W_MAGIC] == child.MAGIC
    channel.owner[slot] = 0
    channel.close_channel()
    with pytest.raises(ValueError):
        channel.words[child.W_MAGIC]
    with pytest.raises(OSError):
        os.fstat(channel.fd)


def test_a_helper_that_cannot_be_made_for_any_reason_leaves_copies_here(monkeypatch, caplog):
    def refuse(index):
        raise RuntimeError("no GPU context here")

    monkeypatch.setattr(_helper, "ENABLED", [True])
    monkeypatch.setattr(_helper, "_HELPERS", {})
    monkeypatch.setattr(_helper, "D2HHelper", refuse)
    assert _helper.for_device(3) is None
    assert _helper._HELPERS == {3: None}
    assert "no GPU context here" in caplog.text
    assert _helper.for_device(3) is None  # not tried again


def test_a_helper_job_delivers_once_and_names_its_copy(served):
    import torch

    from syncless.cc._d2h_job import HelperJob

    channel, device, driver = served
    channel.index = 0
    dst = torch.zeros(4, dtype=torch.int16)
    payload = torch.tensor([1, -2, 3, -4], dtype=torch.int16).numpy().tobytes()
    slot, seq = _post(channel, device, driver, payload)
    job = HelperJob(channel, slot, seq, dst, len(payload))
    assert "(4,) torch.int16" in job.describe() and "cuda:0" in job.describe()
    job()
    job()  # run again (after an interrupt): nothing delivered or freed twice
    assert dst.tolist() == [1, -2, 3, -4]
    assert channel.free.count(slot) == 1


class _Stream:
    cuda_stream = 7


def _helper_offload(monkeypatch, failing_call):
    """One ``offload_to_helper`` whose enqueue fails in ``failing_call``; return the channel it used."""
    import torch

    from syncless.cc import _d2h, _raw
    from syncless.cc._worker import OrderedWorker

    channel = _helper._Channel(SLOTS, SLOT_BYTES)
    channel.usable, channel.ring, channel.events = True, 1 << 20, list(range(SLOTS))

    def enqueue(index, dst_ptr, src_ptr, nbytes, stream, event):
        raise CudaError(failing_call, 1, "CUDA_ERROR_INVALID_VALUE", "stand-in")

    monkeypatch.setattr(_raw, "snapshot_and_record", enqueue)
    monkeypatch.setattr(_d2h, "pinned_block", lambda src, dtype: torch.empty_like(src))
    record = _d2h._D2HStream(_Stream(), worker=OrderedWorker("test-helper-offload"))
    _d2h.resume_offloading()
    with pytest.raises(CudaError):
        _d2h.offload_to_helper(record, torch.arange(4), 0, channel)
    assert record.worker.submitted == 0 and channel.last_seq == 0  # nothing was posted or queued
    return channel


def test_a_helper_snapshot_that_failed_gives_its_slot_back(monkeypatch):
    channel = _helper_offload(monkeypatch, "cuMemcpyDtoDAsync")
    assert sorted(channel.free) == list(range(SLOTS))  # the copy was not enqueued: the slot holds no write


def test_a_failed_record_keeps_the_slot_out(monkeypatch):
    channel = _helper_offload(monkeypatch, "cuEventRecord")
    assert len(channel.free) == SLOTS - 1 and 0 not in channel.free  # its device write is queued

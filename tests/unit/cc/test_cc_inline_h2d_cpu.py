"""Small uploads through kernel parameters (``cc/_inline_h2d.py``) and the waits around them, on a CPU-only torch.

The driver is faked: its ``cuLaunchKernel`` reads the parameter block the launch hands it (through the
``extra`` array, as the driver does) so the tests check the exact bytes a kernel would receive. The PTX itself
is checked on the GPU (``tests/gpu/cc/test_cc_inline_h2d.py``).
"""

from __future__ import annotations

import ctypes
import struct
import threading

import pytest
import torch

from syncless._core import libcuda
from syncless._core.errors import CudaError, MissingDependencyError
from syncless.cc import _inline_h2d


class _FakeDriver:
    """Stands for both libcuda handles: records each launch's function, grid, stream and parameter block."""

    def __init__(self, code: int = 0):
        self.code = code
        self.launches = []

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        words = (ctypes.c_void_p * 5).from_address(extra)
        assert params is None and words[0] == 1 and words[2] == 2 and not words[4]
        size = ctypes.c_size_t.from_address(words[3]).value
        block = ctypes.string_at(words[1], size)
        dst, nbytes = struct.unpack_from("<QI", block, 0)
        self.launches.append({"function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "shared": shared,
                              "stream": stream, "size": size, "dst": dst, "nbytes": nbytes,
                              "payload": block[16:16 + nbytes]})
        return self.code

    def cuGetErrorName(self, code, out):
        out._obj.value = b"CUDA_ERROR_LAUNCH_FAILED"
        return 0

    def cuGetErrorString(self, code, out):
        out._obj.value = b"unspecified launch failure"
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(libcuda, "libraries", lambda: (fake, fake))
    monkeypatch.setattr(libcuda, "LOADED", [(fake, fake)])  # launch reads the loaded list first (a GPU host has one)
    return fake


def test_the_module_has_one_entry_per_size_within_the_launch_limit():
    ptx = _inline_h2d.module_ptx()
    assert ptx.startswith(".version") and ".target sm_70" in ptx
    for size in _inline_h2d.PAYLOAD_SIZES:
        assert f".entry syncless_h2d_inline_{size}(" in ptx
        assert f".b8 payload[{size}]" in ptx
        assert size % 8 == 0 and 16 + size <= 4096  # the header, then an 8-aligned payload: at most 4 KiB in all
    assert _inline_h2d.INLINE_MAX_BYTES == max(_inline_h2d.PAYLOAD_SIZES) == 4080
    from syncless._core import config  # the registry's bound is the kernel's

    assert config.read("SYNCLESS_CC_INLINE_MAX_BYTES", {"SYNCLESS_CC_INLINE_MAX_BYTES": "4080"}) == 4080
    with pytest.raises(ValueError):
        config.read("SYNCLESS_CC_INLINE_MAX_BYTES", {"SYNCLESS_CC_INLINE_MAX_BYTES": "4081"})


@pytest.mark.parametrize("nbytes, slot", [(1, 0), (48, 0), (49, 1), (496, 1), (497, 2), (4080, 2)])
def test_a_launch_carries_the_source_bytes_read_at_the_call(driver, nbytes, slot):
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    expected = bytes(source.tolist())
    entries = (101, 202, 303)
    _inline_h2d.launch(entries, 0xDEAD0000, source.data_ptr(), nbytes, 77)
    source.zero_()  # rewritten right after the call: the launch already holds the bytes
    (launch,) = driver.launches
    assert launch["function"] == entries[slot]
    assert launch["size"] == 16 + _inline_h2d.PAYLOAD_SIZES[slot]
    assert launch["dst"] == 0xDEAD0000 and launch["nbytes"] == nbytes and launch["payload"] == expected
    assert launch["stream"] == 77 and launch["shared"] == 0
    assert launch["block"] == (256, 1, 1) and launch["grid"] == (-(-nbytes // 256), 1, 1)


def test_a_failed_launch_raises_the_drivers_error(driver):
    driver.code = 719
    source = torch.ones(4, dtype=torch.uint8)
    with pytest.raises(CudaError) as caught:
        _inline_h2d.launch((1, 2, 3), 0x1000, source.data_ptr(), 4, 0)
    assert caught.value.code == 719 and caught.value.name == "CUDA_ERROR_LAUNCH_FAILED"
    assert "cuLaunchKernel" in str(caught.value) and "unspecified launch failure" in str(caught.value)


def test_each_host_thread_fills_a_block_of_its_own(driver):
    """Two threads between their packing and their launch must not overwrite each other's bytes."""
    gate = threading.Barrier(2)
    seen = {}
    real_pack = _inline_h2d._pack_header

    def pack_then_wait(buffer, offset, dst, nbytes):
        real_pack(buffer, offset, dst, nbytes)
        gate.wait(5)  # both threads have packed before either launches

    def upload(value: int):
        source = torch.full((32,), value, dtype=torch.uint8)
        _inline_h2d.launch((1, 2, 3), value, source.data_ptr(), 32, 0)
        seen[value] = _inline_h2d._blocks()[0].address

    _inline_h2d._pack_header = pack_then_wait
    try:
        threads = [threading.Thread(target=upload, args=(value,)) for value in (5, 9)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    finally:
        _inline_h2d._pack_header = real_pack
    assert seen[5] != seen[9]
    by_dst = {launch["dst"]: launch["payload"] for launch in driver.launches}
    assert by_dst == {5: bytes([5]) * 32, 9: bytes([9]) * 32}


def test_a_missing_driver_library_says_how_to_fix_it(monkeypatch):
    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "PyDLL", refuse)
    monkeypatch.setattr(libcuda, "_LIBS", [None])
    with pytest.raises(MissingDependencyError, match="LD_LIBRARY_PATH"):
        libcuda.libraries()


def test_the_inline_limit_is_checked_at_install_before_anything_is_patched(monkeypatch):
    from syncless.cc import _shim

    monkeypatch.setenv("SYNCLESS_CC_INLINE_MAX_BYTES", "8KiB")
    from syncless._core.errors import ConfigError

    with pytest.raises(ConfigError, match="SYNCLESS_CC_INLINE_MAX_BYTES=.*from 0 to 4080"):
        _shim.install_shim()
    assert not _shim._STATE.installed


# The waits around it ----------------------------------------------------------------------------------------


def test_a_source_a_pending_offloaded_copy_writes_waits_for_it_before_the_host_reads(monkeypatch):
    from syncless.cc import _d2h, _host_writes

    host = torch.zeros(16, dtype=torch.uint8)
    ticket = (object(), 4)
    waited = []
    states = iter([[("job", ticket)], []])  # pending at the first look; gone once waited for
    monkeypatch.setattr(_host_writes, "_range_if_noted_nearby", lambda src: (src.data_ptr(), src.data_ptr() + 16))
    monkeypatch.setattr(_host_writes, "_unfinished_writes", lambda start, end: next(states))
    monkeypatch.setattr(_d2h, "wait_for_tickets", lambda tickets, raise_errors: waited.append(tickets))
    assert _host_writes.settle_for_host_read(host) is True
    assert waited == [[ticket]]


def test_a_source_a_plain_d2h_may_still_write_is_left_to_the_staging_path(monkeypatch):
    from syncless.cc import _d2h, _host_writes

    host = torch.zeros(16, dtype=torch.uint8)
    monkeypatch.setattr(_host_writes, "_range_if_noted_nearby", lambda src: (src.data_ptr(), src.data_ptr() + 16))
    monkeypatch.setattr(_host_writes, "_unfinished_writes", lambda start, end: [("event", object())])
    monkeypatch.setattr(_d2h, "wait_for_tickets", lambda *a, **k: pytest.fail("a GPU-side write is not host-waited"))
    assert _host_writes.settle_for_host_read(host) is False


def test_a_source_nobody_writes_is_read_at_once():
    from syncless.cc import _host_writes

    _host_writes.clear()
    assert _host_writes._range_if_noted_nearby(torch.zeros(4)) is None
    assert _host_writes.settle_for_host_read(torch.zeros(4)) is True



def test_a_load_that_ran_out_of_memory_is_tried_again_and_a_failed_launch_gives_up(monkeypatch):
    loads = iter([_inline_h2d._RETRY, (11, 22, 33)])
    monkeypatch.setattr(_inline_h2d, "_load", lambda index: next(loads))
    monkeypatch.setattr(_inline_h2d, "_FUNCTIONS", {})
    assert _inline_h2d.functions(0) is None  # out of memory at the JIT: not remembered
    assert _inline_h2d.functions(0) == (11, 22, 33)
    assert _inline_h2d.functions(0) == (11, 22, 33)  # loaded once
    _inline_h2d.give_up(0, RuntimeError("launch refused"))
    assert _inline_h2d.functions(0) is None  # staged from now on


def test_a_dual_level_keeps_d2h_copies_for_torch(monkeypatch):
    import torch.autograd.forward_ad as fwAD

    from syncless.cc import _fast

    assert not _fast.in_dual_level()
    with fwAD.dual_level():
        assert _fast.in_dual_level()


# -- 4- and 8-byte uploads as one stream memory op (cuStreamWriteValue32/64) ------------------------------------


class _WordDriver(_FakeDriver):
    """Also takes stream memory ops: records ``(width, stream, address, value, flags)``; ``refuse``: their code."""

    def __init__(self, refuse: int = 0):
        super().__init__()
        self.words = []
        self.refuse = refuse

    def cuStreamWriteValue64_v2(self, stream, address, value, flags):
        self.words.append((64, stream, address, value, flags))
        return self.refuse

    def cuStreamWriteValue32_v2(self, stream, address, value, flags):
        self.words.append((32, stream, address, value, flags))
        return self.refuse


@pytest.fixture
def word_driver(monkeypatch):
    fake = _WordDriver()
    monkeypatch.setattr(libcuda, "libraries", lambda: (fake, fake))
    monkeypatch.setattr(libcuda, "LOADED", [(fake, fake)])
    monkeypatch.setattr(_inline_h2d, "_WORD_WRITES", {0: True})
    return fake


@pytest.mark.parametrize("dtype, width", [(torch.int64, 64), (torch.int32, 32), (torch.float64, 64),
                                          (torch.float32, 32)])
def test_a_4_or_8_byte_upload_is_one_stream_memory_op_carrying_the_bytes_read_at_the_call(word_driver, dtype,
                                                                                          width):
    if dtype.is_floating_point:
        source = (torch.randn(1) * 1000).to(dtype)
    else:
        source = torch.randint(-2**30, 2**30, (1,), dtype=dtype)
    expected = int.from_bytes(bytes(source.view(torch.uint8).tolist()), "little")
    _inline_h2d.launch((1, 2, 3), 0xBEEF0000, source.data_ptr(), source.nbytes, 77, 0)
    source.zero_()  # rewritten right after the call: the command already holds the value
    assert word_driver.words == [(width, 77, 0xBEEF0000, expected, 0)]  # flags 0: a memory fence before the write
    assert word_driver.launches == []


@pytest.mark.parametrize("nbytes, dst", [(8, 0xBEEF0004), (4, 0xBEEF0002), (2, 0xBEEF0000), (16, 0xBEEF0000),
                                         (7, 0xBEEF0000)])
def test_other_sizes_and_unaligned_destinations_take_the_kernel(word_driver, nbytes, dst):
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    _inline_h2d.launch((1, 2, 3), dst, source.data_ptr(), nbytes, 77, 0)
    assert word_driver.words == [] and len(word_driver.launches) == 1
    assert word_driver.launches[0]["payload"] == bytes(source.tolist())


def test_a_gpu_without_word_writes_takes_the_kernel(word_driver):
    source = torch.ones(1, dtype=torch.int64)
    _inline_h2d.launch((1, 2, 3), 0xBEEF0000, source.data_ptr(), 8, 77, 1)  # GPU 1: never loaded, no word writes
    assert word_driver.words == [] and len(word_driver.launches) == 1


def test_a_refused_memory_op_is_written_by_the_kernel_and_later_ones_go_there_too(word_driver, caplog):
    word_driver.refuse = 801  # CUDA_ERROR_NOT_SUPPORTED: nothing enqueued
    source = torch.full((1,), 12345, dtype=torch.int64)
    with caplog.at_level("WARNING", logger="syncless.cc._inline_h2d"):
        _inline_h2d.launch((1, 2, 3), 0xBEEF0000, source.data_ptr(), 8, 77, 0)
        _inline_h2d.launch((1, 2, 3), 0xBEEF0000, source.data_ptr(), 8, 77, 0)
    assert len(word_driver.words) == 1  # asked once, then the kernel
    assert [launch["payload"] for launch in word_driver.launches] == [bytes(source.view(torch.uint8).tolist())] * 2
    assert sum("cuStreamWriteValue refused" in record.message and "CUDA_ERROR_NOT_SUPPORTED" in record.message
               for record in caplog.records) == 1


def test_a_memory_op_failing_for_another_reason_leaves_word_writes_on(word_driver, caplog):
    """A code that says something other than "this op is not done here" (a context being torn down: 709) sends that
    upload to the kernel, which meets the same state, and does not give word writes up for good."""
    word_driver.refuse = 709  # CUDA_ERROR_CONTEXT_IS_DESTROYED
    source = torch.full((1,), 7, dtype=torch.int64)
    with caplog.at_level("WARNING", logger="syncless.cc._inline_h2d"):
        _inline_h2d.launch((1, 2, 3), 0xBEEF0000, source.data_ptr(), 8, 77, 0)
    assert len(word_driver.words) == 1 and len(word_driver.launches) == 1
    assert _inline_h2d._WORD_WRITES[0] is True
    assert not any("refused" in record.message for record in caplog.records)
    word_driver.refuse = 0
    _inline_h2d.launch((1, 2, 3), 0xBEEF0000, source.data_ptr(), 8, 77, 0)
    assert len(word_driver.words) == 2 and len(word_driver.launches) == 1  # the next one is a word write again


def test_another_failure_of_a_memory_op_is_logged_once_per_gpu_at_debug(word_driver, caplog, monkeypatch):
    monkeypatch.setattr(_inline_h2d, "_OTHER_FAILURES_LOGGED", set())
    word_driver.refuse = 800  # CUDA_ERROR_NOT_PERMITTED: not a refusal of the op itself
    source = torch.full((1,), 7, dtype=torch.int64)
    with caplog.at_level("DEBUG", logger="syncless.cc._inline_h2d"):
        for _ in range(3):
            _inline_h2d.launch((1, 2, 3), 0xBEEF0000, source.data_ptr(), 8, 77, 0)
    assert len(word_driver.words) == 3 and len(word_driver.launches) == 3  # each one asked, then the kernel
    assert sum("CUresult 800" in record.message for record in caplog.records) == 1
    assert _inline_h2d._WORD_WRITES[0] is True


def test_an_invalid_value_refusal_also_stops_word_writes(word_driver):
    word_driver.refuse = 1  # CUDA_ERROR_INVALID_VALUE
    source = torch.full((1,), 7, dtype=torch.int32)
    _inline_h2d.launch((1, 2, 3), 0xBEEF0000, source.data_ptr(), 4, 77, 0)
    assert _inline_h2d._WORD_WRITES[0] is False and len(word_driver.launches) == 1


def test_word_writes_need_the_v2_entry_points_and_the_gpus_64_bit_memory_ops(monkeypatch):
    from syncless._core import cuda

    class Old:  # a driver without the _v2 entry points
        pass

    monkeypatch.setattr(libcuda, "libraries", lambda: (Old(), Old()))
    monkeypatch.setattr(cuda, "supports_64bit_stream_mem_ops", lambda index: True)
    assert _inline_h2d._can_write_words(0) is False
    monkeypatch.setattr(libcuda, "libraries", lambda: (_WordDriver(), _WordDriver()))
    assert _inline_h2d._can_write_words(0) is True
    monkeypatch.setattr(cuda, "supports_64bit_stream_mem_ops", lambda index: False)
    assert _inline_h2d._can_write_words(0) is False

    def refuses(index):
        raise CudaError("cuDeviceGetAttribute", 101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal")

    monkeypatch.setattr(cuda, "supports_64bit_stream_mem_ops", refuses)
    assert _inline_h2d._can_write_words(0) is False

    def breaks(index):
        raise RuntimeError("an error that is not a CudaError")

    monkeypatch.setattr(cuda, "supports_64bit_stream_mem_ops", breaks)
    assert _inline_h2d._can_write_words(0) is False  # (it used to escape, and _load then gave up the whole kernel)

    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(libcuda, "libraries", no_driver)
    assert _inline_h2d._can_write_words(0) is False

"""A ZeroTensor (``torch._efficientzerotensor``) in the shim's copies, on a CPU-only torch.

It is an exact ``torch.Tensor``, strided and contiguous, with ``nbytes`` > 0, but its data pointer is 0: torch's
own copy reads none of it (``.to()`` gives zeros, ``copy_`` from one zero-fills) and refuses to write it. Every path
that moves bytes by pointer must leave it to torch: the fast lane gives up (None / False, having done nothing) and
the general path routes it to torch's own copy (``left_alone["layout"]``). On a GPU the pointer paths read host
address 0 (a segfault) or write device address 0 (the context dies); here the driver's pieces are stand-ins that
log what they were handed, so the old code fails these tests instead of crashing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from syncless.cc import _d2h, _d2h_job, _emulation, _fast, _helper, _host_writes, _inline_h2d, _raw, _routing
from syncless.cc import _shim, _staging, _streams
from syncless.cc._stats import COUNTERS
from support.lane_block import LaneBlock


def _zeros(nbytes: int) -> torch.Tensor:
    """A CPU ZeroTensor of ``nbytes`` bytes of int64 (8 bytes at least)."""
    return torch._efficientzerotensor(max(nbytes // 8, 1), dtype=torch.int64)


def test_a_zerotensor_is_what_the_lanes_cheap_checks_let_through():
    z = _zeros(64)
    assert type(z) is torch.Tensor and z._is_zerotensor()
    assert z.layout is torch.strided and z.is_contiguous() and not z.is_conj() and not z.is_neg()
    assert z.nbytes == 64 and z.data_ptr() == 0


class _CudaZeroBlock(LaneBlock):
    """A CUDA ZeroTensor as the lane reads it (a CPU build cannot make one): a plain block on GPU 0 whose data
    pointer is 0."""

    is_cuda, is_cpu = True, False
    layout = torch.strided

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.shape = (nbytes // 8,)

    def _is_zerotensor(self):
        return True

    def data_ptr(self):
        return 0


@pytest.fixture
def world(monkeypatch):
    """The lane's world with a D2H stream current on GPU 0 (raw stream 7), CC emulated, and every piece that moves
    bytes by pointer replaced by a logger of ``(piece, destination address, source address)``: ``moved`` lists
    them. ``lane.tensor`` is the type the lane takes as a plain tensor (a test may set it)."""
    moved = []

    def logger(name, dst_at, src_at):
        def piece(*args, **kwargs):
            moved.append((name, args[dst_at] if dst_at is not None else None, args[src_at].data_ptr()
                          if src_at is not None and hasattr(args[src_at], "data_ptr") else args[src_at]))
            return name

        return piece

    landed = torch.empty(512, dtype=torch.int64)  # what the lane's allocations hand back (a real address)
    lane = SimpleNamespace(
        ready=True, tensor=torch.Tensor, has_override=lambda t: False, dispatch_depth=lambda: 0,
        functorch_peek=lambda: None, functorch_wrapped=lambda t: False,
        forward_ad=SimpleNamespace(_current_level=-1), device_type=torch.device, devices={},
        current_device=lambda: 0, capturing=lambda: False, raw_stream=lambda index: 7, strided=torch.strided,
        grad_enabled=lambda: True, inference_mode=lambda: False, stream_query=lambda stream: True,
        empty_strided=lambda *args, **kwargs: landed,
        torch_to=lambda t, device, non_blocking: moved.append(("torch_to", None, t.data_ptr())) or "torch's")
    record = _d2h._D2HStream(SimpleNamespace(cuda_stream=0x51))
    record.choice.phase, record.choice.left = 0, 100  # between two trials: the look, not a forced offload
    monkeypatch.setattr(_fast, "_LANE", [lane])
    monkeypatch.setattr(_d2h, "_streams_by_key", {(0, 7): record})
    monkeypatch.setattr(_d2h, "_PENDING", [0])
    monkeypatch.setattr(_helper, "ENABLED", [False])
    monkeypatch.setattr(_emulation, "_installed", True)
    monkeypatch.setattr(_streams, "CAPTURES", [0])
    monkeypatch.setattr(_host_writes, "NOTED_STARTS", [])
    monkeypatch.setattr(_raw, "enter_context", lambda index: False)
    monkeypatch.setattr(_raw, "leave_context", lambda: None)
    monkeypatch.setattr(_raw, "copy_to_host_now", logger("copy_to_host_now", 0, 1))
    monkeypatch.setattr(_raw, "copy_device_block", logger("copy_device_block", 1, 2))
    monkeypatch.setattr(_inline_h2d, "functions", lambda index: (11, 12, 13))
    monkeypatch.setattr(_inline_h2d, "launch", logger("launch", 1, 2))
    monkeypatch.setattr(_d2h, "pinned_block", lambda src, dtype: landed)
    monkeypatch.setattr(_d2h, "offload_block", logger("offload_block", None, 2))
    monkeypatch.setattr(_staging, "land", lambda src, index, current=None: moved.append(("land", None,
                                                                                          src.data_ptr())))
    monkeypatch.setattr(_streams, "current_stream", lambda index: "current")
    monkeypatch.setattr(_streams, "wait_stream_raw", lambda stream: None)  # the emulated wait after torch's copy
    monkeypatch.setattr(_fast, "_clock", iter(range(10 ** 6)).__next__)
    return SimpleNamespace(lane=lane, moved=moved, record=record)


@pytest.mark.parametrize("nbytes", [8, 64, 16 << 10, (1 << 20) + 8])
@pytest.mark.parametrize("idle", [True, False])
def test_the_lane_leaves_the_upload_of_a_host_zerotensor_to_the_general_path(world, nbytes, idle):
    """Inlined (<= 4080 bytes), torch's own on an idle stream, or staged: none of it, since the inline launch reads
    host address 0 (a segfault on a GPU) and the staging reads the ZeroTensor's storage."""
    world.lane.stream_query = lambda stream: idle
    assert _fast.to(_zeros(nbytes), "cuda", 64 << 20, 4080) is None
    assert world.moved == []


def test_a_plain_upload_of_the_same_size_still_takes_the_lane(world):
    """The stand-ins above do log a plain tensor's upload: the tests of ZeroTensors are not vacuous."""
    h = torch.arange(8, dtype=torch.int64)
    assert _fast.to(h, "cuda", 64 << 20, 4080) is not None
    assert world.moved == [("launch", world.lane.empty_strided().data_ptr(), h.data_ptr())]


@pytest.mark.parametrize("nbytes", [8, 64, 8 << 10, 2 << 20])
def test_the_lane_leaves_the_readback_of_a_cuda_zerotensor_to_the_general_path(world, nbytes):
    """Read at the call (under 4 KiB) or offloaded: both move bytes from device address 0."""
    world.lane.tensor = _CudaZeroBlock
    assert _fast.to(_CudaZeroBlock(nbytes), "cpu", 64 << 20, 4080) is None
    assert world.moved == []


def test_a_plain_readback_still_takes_the_lane(world):
    class Block(_CudaZeroBlock):
        def _is_zerotensor(self):
            return False

        def data_ptr(self):
            return 0xD000

    world.lane.tensor = Block
    assert _fast.to(Block(64), "cpu", 64 << 20, 4080) is not None
    assert [(name, src) for name, dst, src in world.moved] == [("copy_to_host_now", 0xD000)]


def _copy_into(dst, src):
    return _fast.copy_into(dst, src, 4080, 64 << 20)


@pytest.mark.parametrize("side", ["src", "dst", "both"])
def test_copy_into_gives_up_on_a_zerotensor_on_either_side(world, side):
    """A ZeroTensor source (the launch would read host address 0) or destination (it would write device address 0,
    where torch raises "ZeroTensors are immutable"): False, nothing done, the shim routes the copy."""
    world.lane.current_device = lambda: -1  # the CPU tensors below stand for the CUDA destination (get_device -1)
    dst = _zeros(64) if side in ("dst", "both") else torch.empty(8, dtype=torch.int64)
    src = _zeros(64) if side in ("src", "both") else torch.ones(8, dtype=torch.int64)
    version = dst._version
    assert _copy_into(dst, src) is False
    assert world.moved == [] and dst._version == version


def test_copy_into_still_inlines_a_plain_upload(world):
    world.lane.current_device = lambda: -1
    dst, src = torch.empty(8, dtype=torch.int64), torch.ones(8, dtype=torch.int64)
    assert _copy_into(dst, src) is True
    assert world.moved == [("launch", dst.data_ptr(), src.data_ptr())]


# -- the general path: routed to torch's own copy, counted as "layout" ------------------------------------------


@pytest.fixture
def routing(monkeypatch):
    """``_shim._decide`` on CPU tensors standing for either side, with a D2H stream current for a CUDA source."""
    monkeypatch.setattr(_streams, "any_current_capture", lambda index: False)
    monkeypatch.setattr(_shim, "_d2h_record", lambda src: "d2h")
    monkeypatch.setattr(_shim._STATE, "max_staged_bytes", 64 << 20)
    COUNTERS.reset()
    yield
    COUNTERS.reset()


def _route(src, dst_type, *, dst=None, src_type=None):
    route, reason, _ = _shim._decide(src, dst_type, 0, into_existing=dst is not None, registered=False,
                                     dtype_changes=False, autograd=False, dst=dst, src_type=src_type)
    return route, reason


@pytest.mark.parametrize("case", ["to_cuda", "copy_from_zero", "copy_into_zero", "copy_both"])
def test_an_upload_with_a_zerotensor_on_either_side_is_torchs_own(routing, case):
    z, h, d = _zeros(64), torch.ones(8, dtype=torch.int64), torch.empty(8, dtype=torch.int64)
    src, dst = {"to_cuda": (z, None), "copy_from_zero": (z, d), "copy_into_zero": (h, _zeros(64)),
                "copy_both": (z, _zeros(64))}[case]
    assert _route(src, "cuda", dst=dst) == (_routing.ORIGINAL, "layout")
    assert COUNTERS.snapshot().left_alone["layout"] == 1


@pytest.mark.parametrize("case", ["to_cpu", "copy_from_zero", "copy_into_zero", "copy_both"])
def test_a_readback_with_a_zerotensor_on_either_side_is_torchs_own_not_offloaded(routing, case):
    """Offloaded, its snapshot would be a raw device copy from address 0 (``CUDA_ERROR_INVALID_VALUE`` on a GPU)."""
    z, d, h = _zeros(64), torch.ones(8, dtype=torch.int64), torch.empty(8, dtype=torch.int64)
    src, dst = {"to_cpu": (z, None), "copy_from_zero": (z, h), "copy_into_zero": (d, _zeros(64)),
                "copy_both": (z, _zeros(64))}[case]
    assert _route(src, "cpu", dst=dst, src_type="cuda") == (_routing.ORIGINAL, "layout")
    assert COUNTERS.snapshot().left_alone["layout"] == 1


def test_a_plain_readback_on_a_d2h_stream_is_still_offloaded(routing):
    assert _route(torch.ones(8), "cpu", src_type="cuda") == (_routing.OFFLOAD, "")


def test_the_offloads_snapshot_of_a_zerotensor_is_torchs_zero_fill_not_a_raw_copy(monkeypatch):
    """Where a ZeroTensor reaches :func:`._d2h_job.snapshot` (the shim routes it away first), torch's copy makes
    its snapshot: zeros, and no raw device copy from address 0."""
    raw = []
    monkeypatch.setattr(_raw, "copy_device_block", lambda *args: raw.append(args))
    z = _zeros(64)
    snap = _d2h_job.snapshot(z, torch.empty(8, dtype=torch.int64), "stream")
    assert raw == []
    assert not snap._is_zerotensor() and snap.data_ptr() != 0 and torch.equal(snap, torch.zeros(8, dtype=torch.int64))


def test_a_zerotensor_is_no_registered_target_and_asking_does_not_raise(monkeypatch):
    target = torch.ones(8)
    monkeypatch.setattr(_staging, "_TARGETS", {})
    _staging._remember_target(target)
    assert _staging.is_registered_target(target)
    assert not _staging.is_registered_target(_zeros(64))

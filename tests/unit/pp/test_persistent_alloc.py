"""Persistent tensors in an allocation of their own, and what depth=0 agrees to share.

Carving and freeing run over host memory here (the DLPack path torch takes
is the same for CPU and CUDA memory); the driver calls of set-up are
stood in for, since what is under test is the decision.
"""

from __future__ import annotations

import ctypes
import gc
import random

import pytest
import torch

from syncless._core.errors import CopyEngineUnavailable, CudaError
from syncless.pp import _copy_engine_setup as setup
from syncless.pp import _persistent as persistent_memory
from syncless.pp._layout import Layout, TensorSpec
from syncless.pp._persistent import ALIGN, Span, exposure_problem

SPECS = {
    "hidden": ((5, 96), torch.bfloat16),
    "stats": TensorSpec(torch.float32, (3, 4), 5),
    "ids": ((5,), torch.int64),
    "flags": ((7,), torch.bool),
    "empty": ((0, 8), torch.float16),
}


class HostMemory:
    """Hands out host buffers as allocations and records every free."""

    def __init__(self):
        self.buffers = {}
        self.freed = []

    def allocate(self, nbytes):
        buffer = ctypes.create_string_buffer(nbytes + ALIGN)
        base = -(-ctypes.addressof(buffer) // ALIGN) * ALIGN
        self.buffers[base] = (buffer, nbytes)
        return base, lambda: self.freed.append(base)


@pytest.fixture
def host():
    memory = HostMemory()
    yield memory
    gc.collect()
    assert persistent_memory.live_allocations() == 0


def test_carved_tensors_have_their_shapes_are_aligned_and_hold_their_own_bytes(host):
    tensors = persistent_memory.carve(SPECS, host.allocate, (1, 0))
    (base, (_, nbytes)), = host.buffers.items()
    assert list(tensors) == list(SPECS)
    expected = {"hidden": (5, 96), "stats": (5, 3, 4), "ids": (5,), "flags": (7,), "empty": (0, 8)}
    for name, tensor in tensors.items():
        assert tuple(tensor.shape) == expected[name] and tensor.is_contiguous()
        if tensor.numel() == 0:
            continue  # torch reports address 0 for a tensor of no elements
        assert tensor.data_ptr() % ALIGN == 0
        assert base <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= base + nbytes
    assert tensors["stats"].dtype == torch.float32 and tensors["flags"].dtype == torch.bool
    gen = torch.Generator().manual_seed(20261130)
    values = {}
    for name, tensor in tensors.items():  # fresh random bits in each; none may clobber another
        bits = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), dtype=torch.uint8, generator=gen)
        tensor.view(torch.uint8).view(-1).copy_(bits)
        values[name] = bits
    for name, tensor in tensors.items():
        assert torch.equal(tensor.view(torch.uint8).view(-1), values[name]), name
    spans = persistent_memory.carved_spans(base)
    assert [span.name for span in spans] == list(SPECS)
    del tensors


def test_the_allocation_is_freed_once_when_the_last_tensor_or_view_dies(host):
    tensors = persistent_memory.carve(SPECS, host.allocate, (1, 0))
    (base,) = host.buffers
    view = tensors["ids"][2:]
    del tensors
    gc.collect()
    assert host.freed == [] and persistent_memory.carved_spans(base) is not None
    del view
    gc.collect()
    assert host.freed == [base]
    assert persistent_memory.carved_spans(base) is None


def test_if_torch_refuses_the_capsule_the_memory_is_freed_at_once(host):
    with pytest.raises((RuntimeError, BufferError, TypeError, ValueError)):
        persistent_memory.carve(SPECS, host.allocate, (99, 0))  # no such DLPack device type
    assert host.freed == list(host.buffers)


@pytest.mark.parametrize("specs, error, match", [
    ({}, TypeError, "non-empty dict"),
    ({"x": torch.float32}, TypeError, r"specs\['x'\] must be a TensorSpec or a \(shape, dtype\)"),
    ({"x": ((4, -1), torch.float32)}, ValueError, r"specs\['x'\].*no negative extent"),
    ({"x": ((), torch.float32)}, ValueError, "leading rows dimension"),
    ({"x": ((4, 2.5), torch.float32)}, TypeError, r"specs\['x'\]"),
    ({3: ((4,), torch.float32)}, TypeError, "keys must be str"),
])
def test_bad_specs_are_refused_before_any_allocation(specs, error, match):
    with pytest.raises(error, match=match):
        persistent_memory.plan(specs)


def test_alloc_persistent_allocates_gpu_memory_only():
    with pytest.raises(ValueError, match="GPU memory for depth=0; got device cpu"):
        persistent_memory.alloc_persistent({"x": ((4,), torch.float32)}, device="cpu")


def test_the_device_allocation_is_whole_pages():
    granule = persistent_memory.ALLOCATION_GRANULE
    assert [persistent_memory.whole_pages(n) for n in (1, granule, granule + 1)] == [granule, granule, 2 * granule]


def test_plan_pads_every_tensor_to_the_alignment():
    layout, nbytes = persistent_memory.plan(
        {"a": ((3,), torch.uint8), "b": ((300,), torch.uint8), "c": ((1,), torch.int8)}
    )
    assert [offset for offset, _, _ in layout.values()] == [0, ALIGN, 3 * ALIGN]
    assert nbytes == 4 * ALIGN


# exposure_problem: what depth=0 may share ---------------------------------------------------

BASE = 1 << 40
MIB = 1 << 20


def _not_ours(base):
    return None


def test_an_alloc_persistent_allocation_with_every_tensor_persistent_is_shared():
    carved = [Span("a", BASE, BASE + 100), Span("b", BASE + 256, BASE + 300)]
    spans = [Span("a", BASE, BASE + 100), Span("b", BASE + 256, BASE + 300)]
    assert exposure_problem({BASE: (512, spans)}, lambda base: carved if base == BASE else None) is None


def test_an_alloc_persistent_allocation_with_a_tensor_left_out_is_refused_naming_it():
    carved = [Span("a", BASE, BASE + 100), Span("kv", BASE + 256, BASE + 300)]
    problem = exposure_problem({BASE: (512, [Span("a", BASE, BASE + 100)])}, lambda base: carved)
    assert "'kv'" in problem and "not persistent" in problem and "persistent['a']" in problem


def test_a_small_tensor_in_a_shared_caching_allocator_segment_is_refused_with_the_fix():
    spans = [Span("hidden", BASE + 4096, BASE + 4096 + 24576)]
    problem = exposure_problem({BASE: (2 * MIB, spans)}, _not_ours)
    assert f"{2 * MIB} bytes of which {2 * MIB - 24576} are not persistent" in problem
    assert "syncless.pp.alloc_persistent" in problem and "depth >= 1" in problem


def test_a_tensor_with_the_rounding_of_its_own_segment_free_is_refused():
    # A 63 MiB + 1 KiB tensor in a 64 MiB segment: the last bytes may serve a small tensor later.
    spans = [Span("hidden", BASE, BASE + 63 * MIB + 1024)]
    assert exposure_problem({BASE: (64 * MIB, spans)}, _not_ours) is not None


def test_an_allocation_the_persistent_tensors_cover_entirely_is_shared():
    spans = [Span("b", BASE + 32 * MIB, BASE + 64 * MIB), Span("a", BASE, BASE + 32 * MIB),
             Span("alias", BASE, BASE + MIB)]  # overlaps count once
    assert exposure_problem({BASE: (64 * MIB, spans)}, _not_ours) is None
    assert exposure_problem({BASE: (64 * MIB + 1, spans)}, _not_ours) is not None


def test_random_layouts_agree_with_a_byte_by_byte_count():
    rng = random.Random(77)
    for _ in range(300):
        size = rng.randint(1, 64)
        spans = []
        for i in range(rng.randint(0, 5)):
            start = rng.randint(0, size)
            spans.append(Span(f"t{i}", BASE + start, BASE + rng.randint(start, size)))
        covered = {b for s in spans for b in range(s.start, s.end)}
        expected_gap = size - len(covered)
        assert persistent_memory._uncovered(BASE, BASE + size, spans) == expected_gap
        assert (exposure_problem({BASE: (size, spans)}, _not_ours) is None) == (expected_gap == 0)


# _share_persistent with the driver stood in for ------------------------------------------------


class _Context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class _FakeDriver:
    """allocation_of answers from a table of allocations; ipc_handle records what was exported."""

    def __init__(self, allocations):
        self.allocations = allocations  # base -> size
        self.exported = []

    def allocation_of(self, ptr):
        for base, size in self.allocations.items():
            if base <= ptr < base + size:
                return base, size
        raise CudaError("cuMemGetAddressRange", 1, "CUDA_ERROR_INVALID_VALUE", "not a device pointer")

    def ipc_handle(self, base):
        self.exported.append(base)
        return base.to_bytes(8, "little") * 8


def _layout(tensors):
    return Layout.from_specs({name: TensorSpec(t.dtype, tuple(t.shape[1:]), t.shape[0]) for name, t in tensors.items()})


def test_share_persistent_exports_an_alloc_persistent_allocation_once(host, monkeypatch):
    tensors = persistent_memory.carve(SPECS, host.allocate, (1, 0))
    (base, (_, nbytes)), = host.buffers.items()
    fake = _FakeDriver({base: nbytes})
    monkeypatch.setattr(setup.drv, "allocation_of", fake.allocation_of)
    monkeypatch.setattr(setup.drv, "ipc_handle", fake.ipc_handle)
    targets, handles = setup._share_persistent(_Context(), tensors, _layout(tensors))
    assert fake.exported == [base] and len(handles) == 1
    offsets = {name: t.data_ptr() - base for name, t in tensors.items()}
    assert targets == [(-1, 0) if name == "empty" else (0, offsets[name]) for name in _layout(tensors).specs]
    del tensors


def test_share_persistent_refuses_tensors_in_a_shared_segment_and_exports_nothing(monkeypatch):
    # Two small tensors as torch's caching allocator places them: in one 2 MiB segment with room for others.
    segment = torch.empty(2 * MIB, dtype=torch.uint8)
    hidden = segment[4096: 4096 + 4 * 96 * 4].view(torch.float32).view(4, 96)
    ids = segment[8192: 8192 + 4 * 8].view(torch.int64)
    fake = _FakeDriver({segment.data_ptr(): 2 * MIB})
    monkeypatch.setattr(setup.drv, "allocation_of", fake.allocation_of)
    monkeypatch.setattr(setup.drv, "ipc_handle", fake.ipc_handle)
    tensors = {"hidden": hidden, "ids": ids}
    with pytest.raises(CopyEngineUnavailable, match=r"whole allocation holding persistent\['hidden', 'ids'\]") as info:
        setup._share_persistent(_Context(), tensors, _layout(tensors))
    assert "alloc_persistent" in str(info.value)
    assert fake.exported == []  # no handle was made, so nothing could have been sent


def test_share_persistent_refuses_memory_the_driver_cannot_place(monkeypatch):
    fake = _FakeDriver({})
    monkeypatch.setattr(setup.drv, "allocation_of", fake.allocation_of)
    tensors = {"hidden": torch.empty(4, 8)}
    with pytest.raises(CopyEngineUnavailable, match=r"persistent\['hidden'\] is not in device memory"):
        setup._share_persistent(_Context(), tensors, _layout(tensors))

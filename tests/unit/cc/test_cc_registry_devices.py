"""Registered in-place targets are told apart by device as well as by address (stand-in GPU tensors)."""

import types

import pytest

from syncless.cc import _staging


class FakeGpuTensor:
    """Stands in for a CUDA tensor of 16 float32 elements: a device index and an address, nothing else."""

    shape, element_size_bytes = (16,), 4

    def __init__(self, index, address):
        self.device = types.SimpleNamespace(index=index)
        self._address = address

    def untyped_storage(self):
        return types.SimpleNamespace(data_ptr=lambda: self._address)

    def data_ptr(self):
        return self._address

    def numel(self):
        return 16

    def stride(self):
        return (1,)

    def element_size(self):
        return self.element_size_bytes


@pytest.fixture(autouse=True)
def empty_registry(monkeypatch):
    monkeypatch.setattr(_staging, "_TARGETS", {})


def test_the_same_address_on_another_gpu_is_not_a_registered_target():
    on_gpu0, on_gpu1 = FakeGpuTensor(0, 0x7F00_0000), FakeGpuTensor(1, 0x7F00_0000)
    assert _staging._remember_target(on_gpu0) is True
    assert _staging.is_registered_target(on_gpu0)
    assert not _staging.is_registered_target(on_gpu1)
    assert _staging._remember_target(on_gpu1) is True  # its own entry, not a replacement
    assert _staging.is_registered_target(on_gpu0) and _staging.is_registered_target(on_gpu1)
    del on_gpu1
    assert _staging.is_registered_target(on_gpu0)

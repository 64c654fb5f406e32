"""What ``make_transport`` and the step checks decide before any collective, in one process (CPU, no peer).

torch.distributed stands in only for the other ranks: an initialized world of two, process groups as
stand-in objects, and the private group's rendezvous replaced by a probe that stops set-up there and
reports what it was given.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from syncless.pp import _make
from syncless.pp._layout import StepCheck, TensorSpec, specs_from_persistent, validate_step


class StandInGroup:
    """A process group of the stand-in world."""

    def __init__(self, ranks, backend):
        self.ranks, self.backend = ranks, backend


class Coordinator:
    """What vLLM's (and SGLang's) ``GroupCoordinator`` holds: a gloo CPU group and the device group."""

    def __init__(self, cpu_group, device_group):
        self.cpu_group, self.device_group = cpu_group, device_group
        self.ranks, self.world_size = list(cpu_group.ranks), len(cpu_group.ranks)


class Reached(Exception):
    """make_transport got to its private group's rendezvous."""


@pytest.fixture
def world(monkeypatch):
    """Rank 0 of an initialized world of two; ``make_transport`` stops at its private group's rendezvous."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "ProcessGroup", StandInGroup)

    def ranks_of(group):
        if not isinstance(group, StandInGroup):
            raise KeyError(group)  # what torch's registry lookup raises for anything else
        return list(group.ranks)

    monkeypatch.setattr(dist, "get_process_group_ranks", ranks_of)

    def rendezvous(ranks, timeout_s):
        raise Reached(tuple(ranks))

    monkeypatch.setattr(_make, "cpu_group", rendezvous)


def test_a_group_coordinator_is_accepted_and_its_groups_picked_by_device(world):
    cpu, nccl = StandInGroup([0, 1], "gloo"), StandInGroup([0, 1], "nccl")
    coordinator = Coordinator(cpu, nccl)
    with pytest.raises(Reached) as info:
        _make.make_transport(coordinator, None)  # the guide's make_transport(pp_group, persistent)
    assert info.value.args == ((0, 1),)
    assert _make._groups_of(coordinator) == (cpu, nccl)  # (for CPU data, for CUDA data)
    assert _make._groups_of(cpu) == (cpu, cpu)


def test_something_that_is_no_group_is_a_type_error_naming_what_to_pass(world):
    class HalfCoordinator:
        cpu_group = StandInGroup([0, 1], "gloo")

    for wrong in (object(), HalfCoordinator(), "pp"):
        with pytest.raises(TypeError, match=r"cpu_group and device_group .* pass pp_group.device_group") as info:
            _make.make_transport(wrong, None)
        assert type(wrong).__name__ in str(info.value)
    mismatched = Coordinator(StandInGroup([0, 1], "gloo"), StandInGroup([0, 2], "nccl"))
    with pytest.raises(ValueError, match=r"cpu_group holds ranks \[0, 1\] but its device_group \[0, 2\]"):
        _make.make_transport(mismatched, None)


def test_cpu_0_is_the_cpu_and_a_first_stage_on_it_can_send():
    device = _make._resolve_device(None, "cpu:0")
    assert device == torch.device("cpu")
    check = StepCheck({"x": TensorSpec(torch.float32, (3,), 4)}, device, "stage 1")
    assert check.rows({"x": torch.randn(2, 3)}) == [2]
    held = {"x": torch.empty(4, 3)}
    assert _make._resolve_device(held, "cpu:0") == torch.device("cpu")  # not "device=cpu:0 but ... cpu"


def test_a_sparse_step_is_a_value_error_before_any_work():
    specs = {"x": TensorSpec(torch.float32, (3,), 4)}
    sparse = torch.randn(2, 3).to_sparse()
    check = StepCheck(specs, torch.device("cpu"), "stage 1")
    for call in (lambda: check.rows({"x": sparse}), lambda: validate_step(specs, {"x": sparse}, torch.device("cpu"),
                                                                         "stage 1")):
        with pytest.raises(ValueError, match=r"send\(\)\['x'\]: expected a dense \(strided\) tensor, got layout "
                                             r"torch.sparse_coo"):
            call()


@pytest.mark.parametrize("kind", ["conjugate", "negative", "sparse"])
def test_a_conjugate_negative_or_sparse_receive_tensor_is_refused_at_make_transport(kind):
    base = torch.zeros(4, 3, dtype=torch.complex64)
    tensor = {"conjugate": base.conj(), "negative": torch._neg_view(base),
              "sparse": torch.zeros(4, 3).to_sparse()}[kind]
    with pytest.raises(ValueError, match=r"persistent\['x'\]") as info:
        specs_from_persistent({"x": tensor, "ok": torch.zeros(4)})
    assert (kind if kind != "sparse" else "layout torch.sparse_coo") in str(info.value)
    assert specs_from_persistent({"x": base})["x"] == TensorSpec(torch.complex64, (3,), 4)  # the plain tensor works

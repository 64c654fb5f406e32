"""Eligibility and agreement logic, fed with fake hardware facts."""

from __future__ import annotations

import pytest

from syncless._core.errors import CopyEngineUnavailable, TransportSetupError
from syncless.pp import describe_local_choice
from syncless.pp._eligibility import LocalFacts, StageDevice, decide, topology_problem, uuid_string
from syncless.pp._group import StageMap, first_failure, resolve_stages


def _links(pairs):
    linked = {frozenset(p) for p in pairs}
    return lambda a, b: frozenset((a, b)) in linked


def test_topology_same_gpu_counts_as_connected_without_asking_nvml():
    def never(a, b):
        raise AssertionError("NVML must not be asked about one GPU")

    devices = [StageDevice("h", "GPU-a", 0), StageDevice("h", "GPU-a", 0), StageDevice("h", "GPU-a", 0)]
    assert topology_problem(devices, never) is None


def test_topology_refuses_pcie_pairs_and_several_nodes():
    devices = [StageDevice("h", "GPU-a", 0), StageDevice("h", "GPU-b", 1), StageDevice("h", "GPU-c", 2)]
    assert topology_problem(devices, _links([("GPU-a", "GPU-b"), ("GPU-b", "GPU-c"), ("GPU-a", "GPU-c")])) is None
    problem = topology_problem(devices, _links([("GPU-a", "GPU-b"), ("GPU-b", "GPU-c")]))
    assert "GPU-a and GPU-c are not NVLink-connected" in problem and "PCIe" in problem
    problem = topology_problem([StageDevice("h1", "GPU-a", 0), StageDevice("h2", "GPU-b", 0)], _links([]))
    assert "several nodes (h1, h2)" in problem


def test_topology_refuses_two_gpus_whose_only_pair_is_pcie():
    devices = [StageDevice("h", "GPU-a", 0), StageDevice("h", "GPU-b", 1)]
    assert topology_problem(devices, _links([("GPU-a", "GPU-b")])) is None
    problem = topology_problem(devices, _links([]))
    assert problem is not None and "GPU-a and GPU-b are not NVLink-connected" in problem


def test_uuid_string_matches_nvml_format():
    raw = bytes(range(16))
    assert uuid_string(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def _facts(**kw):
    base = dict(cuda_available=True, gpu_count=2, mem_ops_64=[True, True], nvlink={(0, 1): True}, peer_access={(0, 1): True})
    base.update(kw)
    return LocalFacts(**base)


def test_decide_copy_engine_when_everything_is_there():
    result = decide(_facts(batch_problem=None))
    assert result["transport"] == "copy_engine"
    assert all(c["ok"] for c in result["checks"])
    assert result["batched_copies"].startswith("yes")


def test_decide_says_why_copies_are_not_batched_and_only_for_copy_engines():
    old_driver = "the driver supports CUDA 12.4; batched copies need 12.8"
    assert decide(_facts(batch_problem=old_driver))["batched_copies"] == f"no: {old_driver}"
    assert "batched_copies" not in decide(_facts(nvlink={(0, 1): False}))  # torch.distributed: not applicable


@pytest.mark.parametrize(
    "facts, words",
    [
        (LocalFacts(False, 0), "CUDA: none"),
        (_facts(nvlink={(0, 1): False}), "NVLink 0<->1: no (PCIe only)"),
        (_facts(nvlink={(0, 1): None}), "NVLink 0<->1: unknown"),
        (_facts(mem_ops_64=[True, False]), "missing on GPU [1]"),
        (_facts(peer_access={(0, 1): False}), "peer access 0<->1: no"),
        (_facts(peer_access={(0, 1): None}), "peer access 0<->1: unknown"),
        (_facts(mem_ops_64=[True]), "64-bit stream memory ops: unknown"),
        # What gather_local_facts leaves when the driver query failed: no mem-ops list, no pair maps.
        (LocalFacts(True, 2, notes=["the CUDA driver could not be queried"]), "64-bit stream memory ops: unknown"),
    ],
)
def test_decide_falls_back_and_says_why(facts, words):
    result = decide(facts)
    assert result["transport"] == "torch_distributed"
    assert words in result["reason"]


def test_decide_respects_the_setting():
    assert decide(_facts(), "torch_distributed")["transport"] == "torch_distributed"
    forced = decide(_facts(nvlink={(0, 1): False}), "copy_engine")
    assert forced["transport"] == "error" and "would raise" in forced["reason"]
    one = decide(_facts(gpu_count=1, mem_ops_64=[True], nvlink={}, peer_access={}))
    assert one["transport"] == "copy_engine" and "one GPU" in one["reason"]


def test_describe_local_choice_reads_the_setting(monkeypatch):
    monkeypatch.setenv("SYNCLESS_PP_TRANSPORT", "torch_distributed")
    assert describe_local_choice(_facts())["transport"] == "torch_distributed"
    monkeypatch.setenv("SYNCLESS_PP_TRANSPORT", "bogus")
    result = describe_local_choice(_facts())
    assert result["transport"] == "copy_engine"
    assert any("SYNCLESS_PP_TRANSPORT" in note for note in result["notes"])


def test_resolve_stages():
    assert resolve_stages([0, 1, 2], 1, None) == StageMap((0, 1, 2), 1)
    reverse = resolve_stages([0, 1], 0, [1, 0])
    assert reverse.index == 1 and reverse.prev_rank == 1 and reverse.next_rank is None
    with pytest.raises(ValueError, match="permutation"):
        resolve_stages([0, 1], 0, [0, 2])
    with pytest.raises(ValueError, match="permutation"):
        resolve_stages([0, 1], 0, [0, 0, 1])
    with pytest.raises(ValueError, match="at least two"):
        resolve_stages([0], 0, None)


def test_first_failure_is_the_earliest_stage_and_keeps_its_kind():
    stages = StageMap((3, 1, 2), 0)
    assert first_failure([None, None, None], stages, "x") is None
    err = first_failure([None, ("unavailable", "no NVLink"), ("error", "boom")], stages, "set-up")
    assert isinstance(err, CopyEngineUnavailable)
    assert str(err) == "set-up failed on stage 1 (rank 1): no NVLink"
    err = first_failure([None, None, ("ValueError", "bad key")], stages, "set-up")
    assert type(err) is ValueError and "stage 2 (rank 2)" in str(err)
    err = first_failure([("error", "RuntimeError: boom"), ("unavailable", "x"), None], stages, "set-up")
    assert type(err) is TransportSetupError and isinstance(err, RuntimeError) and "boom" in str(err)

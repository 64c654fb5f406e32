"""Set-up refusals decided on the CPU: one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``), and depth-0
targets from the next stage that would aim the sender's copies past what it mapped.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from syncless._core.errors import CopyEngineUnavailable, CudaError, TransportSetupError
from syncless.pp import _copy_engine_setup as setup
from syncless.pp import _wire as wire
from syncless.pp._eligibility import MAX_CONNECTIONS_VAR, LocalFacts, StageDevice, connections_problem, decide
from syncless.pp._group import StageMap
from syncless.pp._layout import Layout, TensorSpec

# -- CUDA_DEVICE_MAX_CONNECTIONS -------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", " 1 ", "01"])
def test_one_connection_is_refused_naming_the_variable_and_the_fix(value):
    problem = connections_problem({MAX_CONNECTIONS_VAR: value})
    assert problem is not None and "CUDA_DEVICE_MAX_CONNECTIONS=1" in problem
    assert "Unset CUDA_DEVICE_MAX_CONNECTIONS" in problem and "2 or more" in problem


@pytest.mark.parametrize("environ", [{}, {MAX_CONNECTIONS_VAR: "2"}, {MAX_CONNECTIONS_VAR: "8"},
                                     {MAX_CONNECTIONS_VAR: "32"}, {MAX_CONNECTIONS_VAR: "many"}])
def test_other_settings_are_not_refused(environ):
    assert connections_problem(environ) is None


def test_the_process_environment_is_read_when_no_mapping_is_given(monkeypatch):
    monkeypatch.setenv(MAX_CONNECTIONS_VAR, "1")
    assert connections_problem() is not None
    monkeypatch.delenv(MAX_CONNECTIONS_VAR)
    assert connections_problem() is None


def _facts(**kw):
    base = dict(cuda_available=True, gpu_count=2, mem_ops_64=[True, True], nvlink={(0, 1): True},
                peer_access={(0, 1): True}, batch_problem=None)
    return LocalFacts(**{**base, **kw})


def test_doctor_data_shows_the_hardware_queues_and_falls_back_on_one():
    healthy = decide(_facts())
    queues = [c for c in healthy["checks"] if c["name"] == "hardware queues"]
    assert healthy["transport"] == "copy_engine" and queues[0]["ok"] and "unset" in queues[0]["detail"]
    one = decide(_facts(max_connections="1"))
    assert one["transport"] == "torch_distributed" and "hardware queues: CUDA_DEVICE_MAX_CONNECTIONS=1" in one["reason"]
    forced = decide(_facts(max_connections="1"), "copy_engine")
    assert forced["transport"] == "error" and "CUDA_DEVICE_MAX_CONNECTIONS=1" in forced["reason"]
    assert decide(_facts(max_connections="4"))["transport"] == "copy_engine"


def test_set_up_step_one_refuses_one_connection_on_every_stage(monkeypatch):
    # This process plays stage 0 (rank 0) on a CUDA device whose other checks pass; stage 1 (rank 1) is
    # fine. The refusal travels through agree(), so the error names this stage, as on every rank.
    monkeypatch.setenv(MAX_CONNECTIONS_VAR, "1")
    monkeypatch.setattr(setup, "mem_ops_problem", lambda ordinal: None)
    monkeypatch.setattr(setup, "local_stage_device", lambda ordinal: StageDevice("h", "GPU-a", ordinal))
    other = wire.encode({"rank": 1, "status": None, "value": StageDevice("h", "GPU-b", 1)})

    def all_gather(out, mine, group=None):
        if mine.dtype == torch.int64:
            out[0].fill_(int(mine.item()))
            out[1].fill_(len(other))
            return
        out[0].copy_(mine)
        out[1].zero_()
        out[1][: len(other)] = torch.tensor(list(other), dtype=torch.uint8)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    specs = {"x": TensorSpec(torch.float32, (4,), 8)}
    with pytest.raises(CopyEngineUnavailable, match=r"stage 0 \(rank 0\): CUDA_DEVICE_MAX_CONNECTIONS=1"):
        setup.open_copy_engine(side_group="side", stages=StageMap((0, 1), 0), specs=[{}, specs], persistent={},
                               device=torch.device("cuda", 0), timeout_s=5.0, depth=2, inject_failure=None)


# -- depth 0: the next stage's (handle index, offset) pairs ------------------------------------------------


LAYOUT = Layout.from_specs({"hidden": TensorSpec(torch.bfloat16, (96,), 64),  # 12288 bytes at most
                            "ids": TensorSpec(torch.int64, (), 64),  # 512
                            "none": TensorSpec(torch.float32, (4,), 0)})  # 0


def test_pairs_that_fit_their_mappings_pass():
    setup.check_targets([(0, 0), (0, 12288), (-1, 0)], [12288 + 512], LAYOUT, "stage 1 (rank 1)")
    setup.check_targets([(1, 4096), (0, 0), (-1, 0)], [512, 4096 + 12288], LAYOUT, "stage 1 (rank 1)")


@pytest.mark.parametrize("targets, sizes, match", [
    ([(0, 512), (0, 0), (-1, 0)], [12288], r"persistent\['hidden'\] \(12288 bytes at most\) at byte 512 .* 12288"),
    ([(0, 0), (0, 12288 + 1), (-1, 0)], [12288 + 512], r"persistent\['ids'\] .* at byte 12289"),
    ([(0, 0), (2, 0), (-1, 0)], [1 << 20, 1 << 20], r"persistent\['ids'\] in allocation 2, but it shared 2"),
    ([(0, 0), (-1, 0), (-1, 0)], [1 << 20], r"persistent\['ids'\] in allocation -1"),
    ([(0, 0), (0, 12288)], [1 << 20], "shared 2 depth-0 target"),
    ([(0, 0), (0, 12288), (-1, 0), (0, 0)], [1 << 20], "shared 4 depth-0 target"),
])
def test_pairs_out_of_bounds_are_refused_naming_the_tensor_and_the_numbers(targets, sizes, match):
    with pytest.raises(TransportSetupError, match=match) as info:
        setup.check_targets(targets, sizes, LAYOUT, "stage 1 (rank 1)")
    assert "stage 1 (rank 1)" in str(info.value)


def test_the_mapped_size_comes_from_the_driver_and_a_failure_refuses_copy_engines(monkeypatch):
    monkeypatch.setattr(setup.drv, "allocation_of", lambda ptr: (ptr, 2 << 20))
    assert setup._mapped_size(0x7000_0000, "x") == 2 << 20
    monkeypatch.setattr(setup.drv, "allocation_of", lambda ptr: (ptr - 0x1000, 2 << 20))  # a range around it
    assert setup._mapped_size(0x7000_0000, "x") == (2 << 20) - 0x1000

    def refuse(ptr):
        raise CudaError("cuMemGetAddressRange", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument")

    monkeypatch.setattr(setup.drv, "allocation_of", refuse)
    with pytest.raises(CopyEngineUnavailable, match="could not tell the size of stage 1's buffer"):
        setup._mapped_size(0x7000_0000, "stage 1's buffer")
    monkeypatch.setattr(setup.drv, "allocation_of", lambda ptr: (ptr + 256, 2 << 20))
    with pytest.raises(CopyEngineUnavailable, match="does not hold the address it was mapped at"):
        setup._mapped_size(0x7000_0000, "stage 1's buffer")


def test_a_neighbours_buffer_smaller_than_its_layout_is_refused():
    setup.check_buffer(4096, 4096, "stage 1 (rank 1)")
    with pytest.raises(TransportSetupError, match=r"\(rank 1\)'s buffer has 4095 bytes, but its layout needs 4096"):
        setup.check_buffer(4095, 4096, "stage 1 (rank 1)")

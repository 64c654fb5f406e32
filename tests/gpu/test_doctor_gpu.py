"""``syncless doctor`` on a GPU machine: every GPU, its memory-op support, the driver, CC state.

What needs two GPUs (NVLink between them) is in tests/multi_gpu/test_doctor_gpus.py: under tests/gpu, which
runs on one GPU with SYNCLESS_REQUIRE_GPU=1, it failed instead of running.
"""

import json

import pytest

from syncless import cli
from syncless._core.hardware import cuda_device_count


def _doctor_json(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.gpu
def test_doctor_lists_every_gpu_with_stream_mem_ops(capsys):
    report = _doctor_json(capsys)
    assert len(report["gpus"]) == cuda_device_count()
    for gpu in report["gpus"]:
        assert gpu["stream_mem_ops_64bit"] is True, gpu  # every Hopper GPU supports them
        assert gpu["sm_count"] > 0 and gpu["memory_mib"] > 0
    assert report["software"]["driver"] and report["software"]["nccl"]
    assert report["software"]["cuda_bindings"]
    assert report["missing"] == []


@pytest.mark.gpu
def test_doctor_reads_cc_state_from_nvml(capsys):
    report = _doctor_json(capsys)
    assert "error" not in report["confidential_compute"], report["confidential_compute"]

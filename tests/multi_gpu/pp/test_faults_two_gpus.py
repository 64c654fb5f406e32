"""Faults between two GPUs: fault-table rows, the watchdog's release, one hardware queue refused, graph capture.

The whole table (every fault x phase on both transports) is the script
``tests/multi_gpu/pp/fault_table.py``; these rows keep its main paths in the
GPU suite. Each test spawns ranks with a hard timeout and prints progress.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from support.ranks import run_ranks

_here = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location("pp_cases", _here.parents[1] / "unit" / "pp" / "pp_cases.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)
_spec = importlib.util.spec_from_file_location("fault_table", _here / "fault_table.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)

pytestmark = [pytest.mark.multi_gpu(count=2), pytest.mark.timeout(200)]

TIMEOUT_S = 3.0


@pytest.mark.parametrize(
    "transport, fault, phase",
    [
        ("copy_engine", "sigkill", "between"),  # the receiver dies: the sender's GPU wait is released, it raises
        ("copy_engine", "stall", "step:after_meta"),  # the sender stalls: the receiver raises after the timeout
        ("copy_engine", "sigint", "close"),  # an interrupted close() resumes; nothing is leaked
        ("torch_distributed", "sigint", "step:before_meta"),  # NCCL fallback: a step stopped before its metadata
    ],
)
def test_fault_row(transport, fault, phase):
    row = table.run_row({"device": "cuda", "transport": transport, "fault": fault, "phase": phase}, TIMEOUT_S, 500)
    print(row)
    assert row["verdict"] == "ok", row["problems"]


def test_watchdog_releases_a_stuck_wait_between_two_gpus():
    # CUDA's default of 8 hardware queues, set explicitly so that an inherited setting cannot change the test:
    # the release write (on the private, highest-priority stream) overtakes the blocked flag wait.
    results = run_ranks(cases.gpu_stall, 2, args=(2.0,), devices=[0, 1], timeout_s=120,
                        env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    receiver = results[1]
    assert receiver["synchronize_s"] < 2.0 + 3.0, receiver
    assert "waited" in receiver["error"] and receiver["ids_poisoned"], receiver


def test_one_hardware_queue_is_refused_and_auto_falls_back_to_torch_distributed():
    # With CUDA_DEVICE_MAX_CONNECTIONS=1 the release write queued behind the stuck wait (measured on H200s:
    # the GPU stayed blocked until the peer came back), so the copy-engine transport is not offered there.
    results = run_ranks(cases.one_hardware_queue, 2, devices=[0, 1], timeout_s=120, backend="cpu:gloo,cuda:nccl",
                        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    for stage in results:
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in stage["refused"], stage
        assert stage["backend"] == "torch_distributed", stage
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in stage["fallback_reason"], stage
    assert results[1]["mismatches"] == 0, results[1]


@pytest.mark.parametrize("backend", ["copy_engine", "torch_distributed"])
def test_calls_under_graph_capture_are_refused_and_the_transport_goes_on(backend):
    messages = run_ranks(cases.graph_capture_refused, 2, args=(backend,), devices=[0, 1], timeout_s=120,
                         backend="cpu:gloo,cuda:nccl")
    for stage, call in ((0, "send"), (1, "recv")):
        assert len(messages[stage]) == 1 and f"{call}() was called while the current CUDA stream is capturing" in (
            messages[stage][0])


def test_abort_from_another_thread_and_a_dropped_transport():
    results = run_ranks(cases.abort_and_drop, 2, devices=[0, 1], timeout_s=150)
    receiver = results[1]
    assert receiver["recv_s"] < 3.0 and receiver["error"] == "TransportFailedError", receiver
    assert receiver["recv_error"] == "TransportFailedError", receiver  # the abort's error, not the closed socket
    assert receiver["leaked_nbytes"] > 0 and receiver["raises_after"], receiver
    assert receiver["close_s"] < 3.0, receiver
    for stage in results:
        assert stage["collected"] and stage["watchdogs_alive"] == 0, stage
        assert stage["local_released"] and stage["kept"] == {"allocation": 1, "context": 1}, stage

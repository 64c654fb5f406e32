"""Staged H2D copies wait for the D2H copies still writing their host source (bookkeeping, CPU stand-ins)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from syncless.cc import _d2h, _host_writes, _streams
from syncless.cc._worker import OrderedWorker


@pytest.fixture
def calls(monkeypatch):
    log = []
    worker = OrderedWorker("test-host-writes")
    monkeypatch.setattr(_d2h, "WORKER", worker)
    monkeypatch.setattr(_streams, "wait_flag_geq", lambda stream, addr, value: log.append(("gate", stream, addr, value)))
    monkeypatch.setattr(worker, "wait_for", lambda seq, **kw: log.append(("host waits", seq)))
    _host_writes.clear()
    yield log, worker
    _host_writes.clear()
    worker.shutdown(5.0)


def _staging(index=0):
    return SimpleNamespace(name="staging", device=torch.device("cuda", index))


def test_pending_offloaded_write_orders_the_staging_stream_on_the_gpu(calls):
    log, worker = calls
    host = torch.empty(64)
    worker._submitted = 5  # job 5 is queued, not finished
    _host_writes.note_offloaded_d2h(host, 0, 0xF1A6, 5)
    staging = _staging()
    _host_writes.order_after_pending_writes(staging, host[10:20])  # a view of the same memory
    assert log == [("gate", staging, 0xF1A6, 5)]


def test_finished_or_unrelated_writes_cost_nothing(calls):
    log, worker = calls
    host, other = torch.empty(64), torch.empty(64)
    worker._submitted = worker._completed = 5  # job 5 has finished
    _host_writes.note_offloaded_d2h(host, 0, 0xF1A6, 5)
    _host_writes.order_after_pending_writes(_staging(), host)
    _host_writes.order_after_pending_writes(_staging(), other)
    assert log == []


def test_every_pending_write_is_waited_for_not_only_the_last(calls):
    log, worker = calls
    host = torch.empty(64)
    worker._submitted = 7
    _host_writes.note_offloaded_d2h(host[:32], 0, 0xA, 6)
    _host_writes.note_offloaded_d2h(host[32:], 1, 0xB, 7)  # made on GPU 1: its flag is not on the staging GPU
    staging = _staging(0)
    _host_writes.order_after_pending_writes(staging, host)
    assert log == [("gate", staging, 0xA, 6), ("host waits", 7)]

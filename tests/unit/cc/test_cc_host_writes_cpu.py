"""Staged H2D copies wait for the D2H copies still writing their host source (bookkeeping, CPU stand-ins)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from syncless.cc import _host_writes
from syncless.cc._worker import OrderedWorker


@pytest.fixture
def calls(monkeypatch):
    log = []
    worker = OrderedWorker("test-host-writes")
    monkeypatch.setattr(_host_writes, "_gpu_wait", lambda event, stream: log.append(("gpu waits", event, stream)))
    monkeypatch.setattr(worker, "wait_for", lambda seq, **kw: log.append(("host waits", seq)))
    _host_writes.clear()
    yield log, worker
    _host_writes.clear()
    worker.shutdown(5.0)


def _staging(index=0):
    return SimpleNamespace(name="staging", device=torch.device("cuda", index))


def test_pending_offloaded_write_makes_the_host_wait_for_its_job(calls):
    log, worker = calls
    host = torch.empty(64)
    worker._submitted = 5  # job 5 is queued, not finished
    _host_writes.note_offloaded_d2h(host, (worker, 5))
    staging = _staging()
    _host_writes.order_after_pending_writes(staging, host[10:20])  # a view of the same memory
    assert log == [("host waits", 5)]  # never a GPU-side wait on the worker (it deadlocks on shared queues)


def test_finished_or_unrelated_writes_cost_nothing(calls):
    log, worker = calls
    host, other = torch.empty(64), torch.empty(64)
    worker._submitted = worker._completed = 5  # job 5 has finished
    _host_writes.note_offloaded_d2h(host, (worker, 5))
    _host_writes.order_after_pending_writes(_staging(), host)
    _host_writes.order_after_pending_writes(_staging(), other)
    assert log == []


def test_every_pending_write_is_waited_for_not_only_the_last(calls):
    log, worker = calls
    host = torch.empty(64)
    worker._submitted = 7
    _host_writes.note_offloaded_d2h(host[:32], (worker, 6))
    _host_writes.note_offloaded_d2h(host[32:], (worker, 7))
    _host_writes.order_after_pending_writes(_staging(0), host)
    assert log == [("host waits", 6), ("host waits", 7)]


def test_a_write_through_another_storage_over_the_same_bytes_is_waited_for(calls):
    """Two tensors over one numpy array share bytes, not a storage (found in review: the notes were keyed by
    the storage's address, so a row's D2H was invisible to an upload of the whole array)."""
    import numpy as np

    log, worker = calls
    array = np.zeros((4, 16), dtype=np.float32)
    whole, row = torch.from_numpy(array), torch.from_numpy(array[3])
    assert whole.untyped_storage().data_ptr() != row.untyped_storage().data_ptr()
    worker._submitted = 3
    _host_writes.note_offloaded_d2h(row, (worker, 3))
    _host_writes.order_after_pending_writes(_staging(), whole)
    assert log == [("host waits", 3)]
    log.clear()
    _host_writes.order_after_pending_writes(_staging(), torch.from_numpy(array[1]))  # bytes the write misses
    assert log == []

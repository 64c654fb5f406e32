"""Fixtures for the syncless.cc GPU tests: every test runs under CC emulation."""

from __future__ import annotations

import contextlib

import pytest


@pytest.fixture
def driver_fails_copies_into():
    """``with driver_fails_copies_into(doomed):`` makes the offloaded job's driver copy into ``doomed`` fail."""
    return _driver_fails_copies_into


@contextlib.contextmanager
def _driver_fails_copies_into(doomed):
    """While open, the offloaded job's driver copy into pinned ``doomed`` fails, as a copy the driver fails would."""
    from syncless.cc import _raw

    real_job = _raw.run_copy_job

    def failing_job(index, ready, host_ptr, device_ptr, nbytes, stream):
        if host_ptr == doomed.data_ptr():
            raise RuntimeError("injected copy failure")
        return real_job(index, ready, host_ptr, device_ptr, nbytes, stream)

    _raw.run_copy_job = failing_job
    try:
        yield
    finally:
        _raw.run_copy_job = real_job


@pytest.fixture
def emulated_cc():
    """Install the CC emulator and the shim; restore everything afterwards."""
    import syncless.cc as cc

    cc.uninstall()
    cc.reset_stats()
    cc.install("emulate")
    yield cc
    cc.uninstall()


@pytest.fixture(scope="session")
def cycles_per_ms():
    """GPU clock cycles per millisecond, measured once with torch.cuda._sleep and events."""
    import torch

    torch.cuda.init()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return int(20_000_000 / max(start.elapsed_time(end), 1e-3))

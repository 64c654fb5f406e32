"""A sync made through an installed package names the user's line, via the package's frame (on the GPU).

A fake package is written under a temporary ``site-packages`` and makes a
real host-blocking call: a raw ``cuStreamSynchronize`` (seen by CUPTI only)
and a ``torch.cuda.synchronize()`` (seen by the wrapper). numba, where it
is installed, is checked the same way (``numba.cuda.synchronize()`` was
recorded as ``numba_cuda/.../driver.py`` before).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

import pytest
import torch

from syncless import syncs

from .cupti_fixtures import cupti_detector  # noqa: F401 - fixture used by name

LIBRARY = textwrap.dedent("""
    import torch

    def raw_stream_synchronize():
        from cuda.bindings import driver

        driver.cuStreamSynchronize(driver.CUstream(torch.cuda.current_stream().cuda_stream))

    def torch_synchronize():
        torch.cuda.synchronize()
""")


@pytest.fixture
def installed(tmp_path, cuda_device):
    folder = tmp_path / "env" / "lib" / "python3" / "site-packages" / "fakegpu"
    folder.mkdir(parents=True)
    path = folder / "sync.py"
    path.write_text(LIBRARY)
    spec = importlib.util.spec_from_file_location("fakegpu_sync", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _the_row(line: int):
    found = syncs.report()
    rows = [s for s in found.sites if s.first.filename == __file__ and s.first.lineno == line]
    assert len(rows) == 1 and len(found.sites) == 1, found.format()
    print(found.format())
    return rows[0]


@pytest.mark.gpu
def test_a_raw_cuda_sync_in_an_installed_package_names_the_users_line(cupti_detector, installed):  # noqa: F811
    torch.cuda._sleep(20_000_000)
    with syncs.checking():
        line = sys._getframe().f_lineno + 1
        installed.raw_stream_synchronize()
    row = _the_row(line)
    assert row.layers == ("cupti",)
    assert row.first.via.startswith("fakegpu/sync.py:7 (raw_stream_synchronize)"), row.first.via


@pytest.mark.gpu
def test_a_wrapped_wait_in_an_installed_package_names_the_users_line(cupti_detector, installed):  # noqa: F811
    with syncs.checking():
        line = sys._getframe().f_lineno + 1
        installed.torch_synchronize()
    row = _the_row(line)
    assert "wrapper" in row.layers
    assert row.first.via.startswith("fakegpu/sync.py:10 (torch_synchronize)"), row.first.via


@pytest.mark.gpu
def test_numba_synchronize_names_the_users_line(cupti_detector):  # noqa: F811
    numba_cuda = pytest.importorskip("numba.cuda")
    numba_cuda.synchronize()
    with syncs.checking():
        line = sys._getframe().f_lineno + 1
        numba_cuda.synchronize()
    row = _the_row(line)
    assert "numba" in row.first.via and os.sep not in row.first.via.split(":")[0][:1], row.first.via

"""A sync made through an installed package is the user's line, "via" the package's frame.

The rule is on the frame's file name: a file under ``site-packages`` or
``dist-packages`` is an installed package's (passed, and kept as "via");
a package installed in editable mode lives where its source is, so its
frames are the user's own. Fake packages are written to a temporary
directory laid out like an environment.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from syncless import syncs
from syncless.syncs import _report

from .conftest import TORCH_TEXT


def _module_at(path, name):
    """Import the file ``path`` as module ``name`` (its frames then carry that file name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LIBRARY = textwrap.dedent(f"""
    import warnings

    def synchronize():
        warnings.warn({TORCH_TEXT!r}, UserWarning)  # the CUDA call that blocks, as torch's debug mode says so

    def helper():
        return synchronize()

    def _checked_sync():
        from syncless import syncs

        with syncs.checking():
            synchronize()

    def in_a_thread():
        worker = __import__("threading").Thread(target=_checked_sync)
        worker.start()
        worker.join(10)
""")


@pytest.fixture(params=["site-packages", "dist-packages"])
def installed(request, tmp_path):
    """A fake package installed in an environment's site-packages (or a distribution's dist-packages)."""
    folder = tmp_path / "env" / "lib" / "python3.11" / request.param / "fakecuda" / "cudadrv"
    folder.mkdir(parents=True)
    path = folder / "driver.py"
    path.write_text(LIBRARY)
    return _module_at(path, f"fakecuda_driver_{request.param.replace('-', '_')}")


def test_a_sync_through_an_installed_package_names_the_users_line_via_the_package(installed, fake_mode):
    with syncs.checking():
        installed.helper(); line = __import__("sys")._getframe().f_lineno  # noqa: E702
    site = syncs.report().sites[0]
    assert (site.first.filename, site.first.lineno) == (__file__, line), syncs.report().format()
    assert site.first.via.startswith("fakecuda/cudadrv/driver.py:5 (synchronize)"), site.first.via
    text = syncs.report().format()
    assert "(via fakecuda/cudadrv/driver.py:5 (synchronize))" in text  # in the table
    assert "via: fakecuda/cudadrv/driver.py:5 (synchronize)" in text  # in the site's details
    assert "via fakecuda/cudadrv/driver.py:5" in site.first.message()
    handed_over = _report.SyncSite.from_plain(site.to_plain(), "gw0")  # pytest-xdist hands sites over so
    assert handed_over.first.via == site.first.via


def test_an_editable_package_is_the_users_own_code(tmp_path, fake_mode):
    # An editable install leaves the source where it is (a .pth file in site-packages points there).
    folder = tmp_path / "work" / "mypkg" / "src" / "mypkg"
    folder.mkdir(parents=True)
    path = folder / "engine.py"
    path.write_text(LIBRARY)
    module = _module_at(path, "mypkg_engine")
    with syncs.checking():
        module.helper()
    site = syncs.report().sites[0]
    assert (site.first.filename, site.first.lineno, site.first.via) == (str(path), 5, ""), syncs.report().format()


def test_a_package_thread_with_no_user_frame_names_the_package(installed, fake_mode):
    # The package's own thread, started by the standard library: no user line is on its stack.
    installed.in_a_thread()
    site = syncs.report().sites[0]
    assert site.first.filename == installed.__file__ and site.first.lineno == 5, syncs.report().format()
    assert site.first.via == ""


def test_syncless_frames_stay_plumbing_and_torch_frames_are_not_via(fake_mode):
    import syncless.syncs._state as state_module

    assert not _report.is_installed_package_file(state_module.__file__) or _report.is_plumbing_file(state_module.__file__)
    with syncs.checking():
        __import__("warnings").warn(TORCH_TEXT, UserWarning); line = __import__("sys")._getframe().f_lineno  # noqa: E702
    site = syncs.report().sites[0]
    assert (site.first.lineno, site.first.via) == (line, ""), syncs.report().format()

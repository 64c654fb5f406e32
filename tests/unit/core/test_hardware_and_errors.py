"""The GPU test gate, error messages and the lazy CUDA layer on a machine without GPU."""

import os
import subprocess
import sys

import pytest

from syncless._core import cuda
from syncless._core.errors import CudaError, MissingDependencyError, SynclessError
from syncless._core.hardware import gpu_gate
from syncless._core.logs import forget_logged, log_once


@pytest.mark.parametrize(
    ("needed", "available", "required", "action"),
    [(0, 0, True, "run"), (1, 1, True, "run"), (2, 8, False, "run"), (1, 0, False, "skip"), (1, 0, True, "fail"), (2, 1, True, "fail")],
)
def test_gpu_gate(needed, available, required, action):
    got, reason = gpu_gate(needed, available, required)
    assert got == action
    if action != "run":
        assert f"needs {needed} CUDA GPU" in reason and f"found {available}" in reason
    if action == "fail":
        assert "SYNCLESS_REQUIRE_GPU" in reason


def test_cuda_error_carries_driver_name_and_hint():
    err = CudaError("cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", "check the handle")
    assert isinstance(err, SynclessError)
    assert err.name == "CUDA_ERROR_INVALID_VALUE"
    assert str(err) == "cuIpcOpenMemHandle failed with CUDA_ERROR_INVALID_VALUE (1): invalid argument. check the handle"


def test_importing_syncless_touches_no_cuda():
    code = (
        "import sys, syncless, syncless._core, syncless._core.cuda, syncless.cli, syncless.doctor, syncless.bench;"
        "bad = [m for m in ('cuda.bindings', 'cuda.bindings.driver', 'pynvml') if m in sys.modules];"
        "print(bad); assert not bad"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


def test_check_turns_results_into_values_or_errors():
    pytest.importorskip("cuda.bindings")
    drv = cuda.driver_module()
    ok = drv.CUresult.CUDA_SUCCESS
    assert cuda.check("cuFake", (ok,)) is None
    assert cuda.check("cuFake", (ok, 7)) == 7
    assert cuda.check("cuFake", (ok, 7, 8)) == (7, 8)
    with pytest.raises(CudaError) as info:
        cuda.check("cuFake", (drv.CUresult.CUDA_ERROR_INVALID_VALUE,))
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE" and info.value.call == "cuFake"


def test_missing_driver_says_how_to_fix(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    pytest.importorskip("cuda.bindings")
    with pytest.raises(MissingDependencyError, match="NVIDIA driver|no GPU"):
        cuda.ensure_driver()


def test_log_once(caplog):
    import logging

    logger = logging.getLogger("syncless.test_log_once")
    forget_logged("unit-test")
    with caplog.at_level(logging.INFO, logger=logger.name):
        assert log_once(logger, logging.INFO, "unit-test-key", "fallback: %s", "reason")
        assert not log_once(logger, logging.INFO, "unit-test-key", "fallback: %s", "reason")
    assert [r.getMessage() for r in caplog.records] == ["fallback: reason"]


def test_building_the_command_line_imports_no_torch():
    # `syncless --help` and argument errors answer at once: torch (seconds to import) loads only to run a command.
    code = "import sys; from syncless.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "False", out.stderr


def test_no_module_of_syncless_imports_the_command_line():
    """The subcommands' modules raise UsageError and use the exit statuses from _core.exits, not from cli."""
    import pathlib
    import re

    import syncless

    root = pathlib.Path(syncless.__file__).parent
    importers = [str(path.relative_to(root)) for path in sorted(root.rglob("*.py"))
                 if path.name not in ("cli.py", "__main__.py")
                 and re.search(r"^\s*(from syncless\.cli import|from syncless import cli\b|import syncless\.cli)",
                               path.read_text(), flags=re.MULTILINE)]
    assert importers == [], f"these modules import syncless.cli: {importers}"
    from syncless import cli
    from syncless._core import exits

    assert cli.UsageError is exits.UsageError and cli.EXIT_USAGE == exits.EXIT_USAGE == 2

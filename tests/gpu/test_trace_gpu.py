"""``syncless trace`` on a real GPU, as a user runs it (a subprocess): --fail-on-sync, a re-exported function, Ctrl-C.

Issues #28 (items 2 and 14) and #26 (item 10). Each run has a hard timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

STEP = """
import torch

def step(x):
    return (x * 2).sum().item()
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNCLESS_")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _trace(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "syncless", "trace", "--backend", "torch", *argv], cwd=cwd,
                          capture_output=True, text=True, env=_env(), timeout=180)


def _counts(out: str, filename: str) -> dict[str, int]:
    """count per site (shown relative to the run's folder) of the report's rows that point into ``filename``."""
    return {row.split()[1]: int(row.split()[0]) for row in out.splitlines()
            if f"{filename}:" in row and row.split()[0].isdigit()}


@pytest.mark.gpu
def test_fail_on_sync_fails_a_run_whose_checked_step_syncs(tmp_path, cuda_device):
    (tmp_path / "ci.py").write_text(STEP + textwrap.dedent("""
        x = torch.randn(1024, device="cuda")
        for _ in range(4):
            step(x)
    """))
    plain = _trace("--fn", "__main__:step", "ci.py", cwd=tmp_path)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    failing = _trace("--fail-on-sync", "--fn", "__main__:step", "ci.py", cwd=tmp_path)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert _counts(failing.stdout, "ci.py") == {"ci.py:5": 4}, failing.stdout
    assert "--fail-on-sync: 4 hidden GPU sync(s) at 1 call site(s); exit status 1" in failing.stderr


@pytest.mark.gpu
def test_a_function_the_package_re_exports_is_checked_through_the_public_name(tmp_path, cuda_device):
    (tmp_path / "hotpkg").mkdir()
    (tmp_path / "hotpkg" / "__init__.py").write_text("from .engine import step\n")
    (tmp_path / "hotpkg" / "engine.py").write_text(STEP)
    (tmp_path / "main.py").write_text(textwrap.dedent("""
        import torch
        import hotpkg

        x = torch.randn(1024, device="cuda")
        for _ in range(3):
            hotpkg.step(x)
    """))
    result = _trace("--fn", "hotpkg.engine:step", "main.py", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _counts(result.stdout, "engine.py") == {"hotpkg/engine.py:5": 3}, result.stdout


@pytest.mark.gpu
def test_ctrl_c_ends_a_trace_of_a_loop_with_the_syncs_found_so_far(tmp_path, cuda_device):
    (tmp_path / "serve.py").write_text(STEP + textwrap.dedent("""
        x = torch.randn(1024, device="cuda")
        step(x)
        print("serving", flush=True)
        while True:
            step(x)
    """))
    process = subprocess.Popen([sys.executable, "-m", "syncless", "trace", "--backend", "torch", "--fn",
                                "__main__:step", "serve.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert process.stdout.readline().strip() == "serving"
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, out + err
    assert "[interrupted (Ctrl-C)]" in out
    counts = _counts(out, "serve.py")
    assert list(counts) == ["serve.py:5"] and counts["serve.py:5"] > 1, out

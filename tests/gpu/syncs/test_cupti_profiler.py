"""torch.profiler and the CUPTI backend in one process, in both orders (each in a fresh process).

CUPTI allows one subscriber per process and torch.profiler (kineto) is one.
Either order must work, or syncless must say clearly why it fell back to
the torch backend; the profiler must keep its CUDA activities when syncless
let CUPTI go before it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .cupti_fixtures import require_cupti

SRC = str(Path(__file__).resolve().parents[3] / "src")

PRELUDE = textwrap.dedent("""
    import logging, sys
    import torch
    from cuda.bindings import driver as drv
    from syncless import syncs
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    x = torch.randn(1 << 16, device="cuda")
    torch.cuda.synchronize()

    def profile_cuda_events():
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            y = x * 3 + 1
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    def check_with_syncless():
        syncs.set_mode("record")
        syncs.set_backend("auto")
        assert syncs.enable()
        with syncs.checking():
            x.sum().item()                  # ITEM_LINE
            drv.cuCtxSynchronize()          # RAW_LINE
        choice = syncs.backend_choice()
        print("CHOICE", choice.active, "|", choice.reason, flush=True)
        print(syncs.report().format(stacks=False), flush=True)
        syncs.reset()  # the at-exit report of record mode would print the same rows again
        syncs.disable()
        return choice
""")

PROFILER_FIRST = PRELUDE + textwrap.dedent("""
    print("PROFILER_CUDA_EVENTS", profile_cuda_events(), flush=True)
    check_with_syncless()
""")

SYNCLESS_FIRST = PRELUDE + textwrap.dedent("""
    check_with_syncless()
    print("PROFILER_CUDA_EVENTS", profile_cuda_events(), flush=True)
""")


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print("running a fresh process (timeout 240 s)", flush=True)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    print(done.stdout)
    print(done.stderr[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


def _value(text: str, key: str) -> str:
    for line in text.splitlines():
        if line.startswith(key):
            return line[len(key):].strip()
    raise AssertionError(f"{key} missing from:\n{text}")


def _rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if "<string>:" in line and line.split()[0].isdigit()]


def _check_syncless_part(text: str) -> str:
    """Either CUPTI checked (both syncs, the .item() once) or the fallback was explained; return which."""
    active, _, reason = _value(text, "CHOICE").partition("|")
    rows = _rows(text)
    if active.strip() == "cupti":
        assert len(rows) == 2 and "torch+cupti" in text, text  # .item() once with both layers; the raw call too
    else:
        assert active.strip() == "torch" and "another CUPTI subscriber" in reason, reason
        assert len(rows) == 1 and "torch+cupti" not in text, text  # torch still catches the .item()
        assert text.count("CUPTI cannot be used") == 1, text  # said once, with the reason
    return active.strip()


@pytest.mark.gpu
def test_profiler_first_then_syncless(cuda_device):
    require_cupti()
    text = _run(PROFILER_FIRST)
    assert int(_value(text, "PROFILER_CUDA_EVENTS")) > 0
    print("syncless after the profiler used:", _check_syncless_part(text))


@pytest.mark.gpu
def test_syncless_first_then_profiler(cuda_device):
    require_cupti()
    text = _run(SYNCLESS_FIRST)
    assert _check_syncless_part(text) == "cupti", text  # nothing held CUPTI before us
    assert int(_value(text, "PROFILER_CUDA_EVENTS")) > 0, "the profiler lost its CUDA activities after syncless"

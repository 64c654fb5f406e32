"""Issue 17, item 5: where nothing could be checked, the report says so once, and why; never "no syncs"."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import torch

from syncless import syncs
from syncless.syncs import _debugmode, _trace


def test_a_report_where_the_detector_could_not_start_says_nothing_was_checked(restored_globals, monkeypatch):
    with _debugmode.fake() as stand_in:
        monkeypatch.setattr(stand_in, "unavailable_reason", lambda: "no CUDA GPU is visible to torch")
        syncs.set_mode("record")
        assert not syncs.enable()
        text = syncs.report().format()
    assert text.startswith("syncless: NOTHING WAS CHECKED: no CUDA GPU is visible to torch")
    assert "no hidden GPU syncs recorded" not in text
    with _debugmode.fake():  # once it could start, an empty record is good news again
        assert syncs.enable()
        assert "no hidden GPU syncs recorded" in syncs.report().format()


def test_a_report_before_enable_says_nothing_was_checked():
    code = "from syncless import syncs; syncs.set_mode('record'); print(syncs.report().format())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "NOTHING WAS CHECKED: syncs.enable() has not made the detector active" in out


def test_trace_on_a_cpu_build_says_it_once_on_stdout(tmp_path, capsys, restored_globals):
    if hasattr(torch._C, "_cuda_set_sync_debug_mode") and torch.cuda.is_available():
        import pytest

        pytest.skip("this machine can check syncs")
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent("""
        def step(i):
            return i
        step(1)
    """))
    parser = argparse.ArgumentParser()
    _trace.add_arguments(parser)
    assert _trace.run(parser.parse_args(["--fn", "__main__:step", str(script)])) == 0
    captured = capsys.readouterr()
    assert captured.out.count("NOTHING WAS CHECKED") == 1, captured.out
    assert "no hidden GPU syncs recorded" not in captured.out
    assert "nothing can be checked here" not in captured.err  # trace no longer repeats it on stderr

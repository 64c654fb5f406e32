"""The record (one row per call site with its count and one stack) and ``syncless trace``."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from syncless import syncs
from syncless._core.errors import SyncViolation
from syncless.syncs import _debugmode, _report, _trace

from .conftest import torch_sync_warning

FAKE_SYNC = (
    "import functools, warnings\n"
    "sync = functools.partial(warnings.warn, 'called a synchronizing CUDA operation', UserWarning)\n"
)


def test_record_counts_each_site_once_with_one_stack(fake_mode):
    with syncs.checking():
        for _ in range(4):
            first = sys._getframe().f_lineno + 1
            torch_sync_warning()
        second = sys._getframe().f_lineno + 1
        torch_sync_warning()
    found = syncs.report()
    assert [(s.first.lineno, s.count) for s in found.sites] == [(first, 4), (second, 1)]
    assert found.total == 5
    text = found.format()
    here = Path(__file__).name
    assert f"{here}:{first}" in text and f"{here}:{second}" in text
    assert text.count("--- ") == 2  # one stack per site
    assert "syncless/syncs" not in text  # the user's frames only
    syncs.reset()
    assert not syncs.report() and "no hidden GPU syncs" in syncs.report().format()


def run_trace(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    _trace.add_arguments(parser)
    return _trace.run(parser.parse_args(argv))


def test_trace_checks_a_function_of_the_script(tmp_path, capsys, restored_globals):
    script = tmp_path / "loop.py"
    script.write_text(FAKE_SYNC + textwrap.dedent("""
        def step(i):
            sync()
            return i

        def setup():
            sync()

        setup()
        total = sum(step(i) for i in range(3))
        assert total == 3
    """))
    with _debugmode.fake():
        assert run_trace(["--fn", "__main__:step", str(script)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if "loop.py:" in line and "explicit" in line]
    assert [(row[0], row[1]) for row in rows] == [("3", f"{script}:5")]
    assert "loop.py:9" not in out  # setup() is not checked
    assert not syncs.report() and not syncs.is_enabled()


def test_trace_checks_a_method_of_an_imported_module(tmp_path, capsys, monkeypatch, restored_globals):
    module = tmp_path / "hotmod.py"
    module.write_text(FAKE_SYNC + textwrap.dedent("""
        class Engine:
            def step(self):
                sync()

            @staticmethod
            def helper():
                sync()
    """))
    script = tmp_path / "main.py"
    script.write_text("import hotmod\nengine = hotmod.Engine()\nfor _ in range(2):\n    engine.step()\n    engine.helper()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hotmod", raising=False)
    with _debugmode.fake():
        status = run_trace(["--fn", "hotmod:Engine.step", "--fn", "hotmod:Engine.helper", str(script)])
    assert status == 0
    out = capsys.readouterr().out
    counts = {line.split()[1]: line.split()[0] for line in out.splitlines() if "hotmod.py:" in line and "explicit" in line}
    assert counts == {f"{module}:6": "2", f"{module}:10": "2"}
    import hotmod

    assert isinstance(hotmod.Engine.__dict__["helper"], staticmethod)
    assert not hasattr(hotmod.Engine.step, "__wrapped__")  # the original is back


def test_trace_rejects_bad_targets(tmp_path, capsys, restored_globals):
    script = tmp_path / "s.py"
    script.write_text("x = 1\n")
    assert run_trace(["--fn", "no_colon", str(script)]) == 2
    assert "MODULE:QUALNAME" in capsys.readouterr().err
    assert run_trace(["--fn", "__main__:missing", str(script)]) == 2
    assert "defines no function missing" in capsys.readouterr().err
    assert run_trace([str(tmp_path / "absent.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    # A module that cannot be imported, or a name that is not a function: the message names the option.
    assert run_trace(["--fn", "syncless_no_such_module:f", str(script)]) == 2
    assert capsys.readouterr().err.strip() == (
        "syncless trace: error: --fn syncless_no_such_module:f: No module named 'syncless_no_such_module'")
    assert run_trace(["--fn", "os:sep", str(script)]) == 2
    assert capsys.readouterr().err.strip() == "syncless trace: error: --fn os:sep: it is a str, not a function"


def test_trace_without_a_script_says_so_in_words(capsys, restored_globals):
    from syncless import cli

    assert cli.main(["trace"]) == 2
    err = capsys.readouterr().err
    assert "no script given; name the Python script to run" in err
    assert "script_args" not in err and "required" not in err
    assert cli.main(["trace", "--fn", "m:f"]) == 2
    assert "no script given" in capsys.readouterr().err


def test_trace_help_shows_the_defaults(capsys):
    from syncless import cli

    with pytest.raises(SystemExit):
        cli.main(["trace", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "script [ARGS...]" in out
    assert "(repeatable; default: none" in out and "default: SYNCLESS_SYNC_BACKEND, else auto" in out
    assert "arguments passed to the script (default: none)" in out


def test_trace_returns_the_scripts_exit_status(tmp_path, capsys, restored_globals):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    with _debugmode.fake():
        assert run_trace([str(script)]) == 3
    assert "no hidden GPU syncs" in capsys.readouterr().out


def test_hook_drops_torchs_prototype_notice_and_forwards_other_warnings(monkeypatch):
    from syncless.syncs import _hook

    seen = []
    monkeypatch.setattr(_hook, "_previous", lambda *args: seen.append(str(args[0])))
    monkeypatch.setattr(_hook, "_installed", True)  # as between install() and the hook's release
    _hook.showwarning(UserWarning(_hook.TORCH_PROTOTYPE_TEXT + " and does not yet detect all"), UserWarning, "f.py", 1)
    _hook.showwarning(UserWarning("something else"), UserWarning, "f.py", 2)
    assert seen == ["something else"]


def _locate_here(operation):
    from syncless.syncs import _report

    return _report.locate(_report.KIND_WAIT, operation, _report.FIX_WAIT, sys._getframe())  # one call site


def test_a_repeated_site_skips_formatting_its_stack_except_in_error_mode(fake_mode, monkeypatch):
    from syncless.syncs import _report, _state

    syncs.reset()
    first = _locate_here("a wait")
    _report.recorder.add(first)
    again = _locate_here("a wait")
    assert "_locate_here" in first.stack and again.stack == ""
    assert _locate_here("another wait").stack  # another operation at the same line is another site
    monkeypatch.setattr(_state.settings, "mode", "error")
    assert _locate_here("a wait").stack  # error mode raises it with the violation
    _report.recorder.add(again)
    assert syncs.report().sites[0].first.stack == first.stack and syncs.report().total == 2
    syncs.reset()


def test_a_site_recorded_without_its_stack_takes_the_next_one(fake_mode):
    # A reset() on another thread between locate() and add() can record a repeat, which has no stack.
    from syncless.syncs import _report

    syncs.reset()
    with_stack = _locate_here("a wait")
    stackless = _report.Violation(**{**with_stack.__dict__, "stack": ""})
    _report.recorder.add(stackless)
    assert not _report.recorder.knows(with_stack.filename, with_stack.lineno, "a wait")
    again = _locate_here("a wait")
    assert again.stack  # not skipped: the record has no stack for the site yet
    _report.recorder.add(again)
    site = syncs.report().sites[0]
    assert site.count == 2 and site.first.stack == again.stack
    syncs.reset()


# ---- compile-time frames, handling in each mode, the exit report ---------------

def _torch_helper(relative_path):
    """A function whose code claims to live in torch at ``relative_path`` and locates a sync from there."""
    filename = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), *relative_path.split("/"))
    namespace = {}
    source = "import sys\ndef run(locate, *args):\n    return locate(*args, sys._getframe())\n"
    exec(compile(source, filename, "exec"), namespace)
    return namespace["run"]


def test_a_sync_under_compile_time_torch_code_is_skipped():
    under_dynamo = _torch_helper("_dynamo/convert_frame.py")
    assert under_dynamo(_report.locate, _report.KIND_EXPLICIT, "a sync", _report.FIX_EXPLICIT) is None
    # Other torch code is skipped over to the caller (this file) instead.
    elsewhere = _torch_helper("_syncless_test_helper.py")
    line = sys._getframe().f_lineno + 1
    found = elsewhere(_report.locate, _report.KIND_EXPLICIT, "a sync", _report.FIX_EXPLICIT)
    assert (found.filename, found.lineno) == (__file__, line)


def _syncless_helper(relative_path):
    """A function whose code claims to live in syncless at ``relative_path``; it locates a sync inside a nested call."""
    import syncless

    filename = os.path.join(os.path.dirname(os.path.abspath(syncless.__file__)), *relative_path.split("/"))
    namespace = {}
    source = ("import sys\n"
              "def run(inner, *args):\n"
              "    return inner(*args)\n")  # the line every located sync below is attributed to, when it counts
    exec(compile(source, filename, "exec"), namespace)
    return namespace["run"]


def test_the_demos_frames_count_as_user_code_and_syncless_plumbing_does_not():
    def locate_from_caller(*args):
        return _report.locate(*args, sys._getframe().f_back)

    # The demo's stage (e.g. --plant-sync's .item()) is where the sync is, not the process launcher above it.
    in_demo = _syncless_helper("demo/_stage_for_test.py")
    found = in_demo(locate_from_caller, _report.KIND_EXPLICIT, "a sync", _report.FIX_EXPLICIT)
    assert found.filename.endswith(os.path.join("syncless", "demo", "_stage_for_test.py")), found.filename
    assert (found.lineno, found.function) == (3, "run")
    assert "_stage_for_test.py" in found.stack
    # Any other syncless frame is plumbing: the sync is attributed to this test, the caller.
    in_plumbing = _syncless_helper("syncs/_plumbing_for_test.py")
    line = sys._getframe().f_lineno + 1
    found = in_plumbing(locate_from_caller, _report.KIND_EXPLICIT, "a sync", _report.FIX_EXPLICIT)
    assert (found.filename, found.lineno) == (__file__, line)
    assert "_plumbing_for_test.py" not in found.stack


def _violation():
    return _report.Violation(_report.KIND_WAIT, "a wait", "user.py", 7, "step", _report.FIX_WAIT, "stack\n", "main")


def test_error_mode_records_before_raising(restored_globals):
    syncs.set_mode("error")
    syncs.reset()
    violation = _violation()
    with pytest.raises(SyncViolation, match="user.py:7") as info:
        _report.handle(violation)
    assert info.value.violation is violation
    assert [(s.first, s.count) for s in syncs.report().sites] == [(violation, 1)]


def test_warn_mode_delivers_through_forward_warning_when_given(restored_globals):
    syncs.set_mode("warn")
    syncs.reset()
    delivered = []
    with warnings.catch_warnings(record=True) as through_warnings:
        warnings.simplefilter("always")
        _report.handle(_violation(), forward_warning=lambda *args: delivered.append(args))
    assert through_warnings == []
    [(message, category, filename, lineno)] = delivered
    assert isinstance(message, _report.SyncWarning) and category is _report.SyncWarning
    assert (filename, lineno) == ("user.py", 7) and "user.py:7" in str(message)
    with pytest.warns(_report.SyncWarning, match="user.py:7"):
        _report.handle(_violation())  # without one: the warnings module
    assert syncs.report().total == 2


def test_print_at_exit_registers_once_and_prints_the_record(monkeypatch, capsys):
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    recorder = _report._Recorder()  # not the process-wide one
    recorder.print_at_exit()
    recorder.print_at_exit()
    assert len(registered) == 1
    registered[0]()
    assert capsys.readouterr().err == ""  # nothing recorded: nothing printed
    recorder.add(_violation())
    registered[0]()
    assert "user.py:7" in capsys.readouterr().err


def test_a_report_is_a_snapshot_that_later_syncs_leave_alone(fake_mode):
    def sync_at_one_line():
        torch_sync_warning()

    with syncs.checking():
        sync_at_one_line()
        earlier = syncs.report()
        text = earlier.format()
        for _ in range(5):
            sync_at_one_line()
    assert (earlier.total, earlier.sites[0].count) == (1, 1)
    assert earlier.format() == text
    assert syncs.report().total == 6
    earlier.sites[0].api_calls["cudaFree"] = 1  # a caller's edit stays in its copy
    assert not syncs.report().sites[0].api_calls

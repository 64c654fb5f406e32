"""The command line as a new user meets it: one-line errors, exit statuses, no process left behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from syncless import cli

SRC = str(Path(__file__).resolve().parents[3] / "src")


def _env(**changes):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNCLESS_")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(changes)
    return env


def _syncless(*argv, timeout=120, **env):
    return subprocess.run([sys.executable, "-m", "syncless", *argv], capture_output=True, text=True,
                          env=_env(**env), timeout=timeout)


def test_a_bad_sync_check_leaves_version_and_doctor_working_and_other_commands_refuse_in_one_line():
    assert _syncless("--version", SYNCLESS_SYNC_CHECK="bogus").stdout.strip().startswith("syncless ")
    doctor = _syncless("doctor", SYNCLESS_SYNC_CHECK="bogus")
    assert doctor.returncode == 1 and "INVALID" in doctor.stdout and "Traceback" not in doctor.stderr
    trace = _syncless("trace", "script.py", SYNCLESS_SYNC_CHECK="bogus")
    assert trace.returncode == 2
    assert trace.stderr.strip().splitlines() == [
        "syncless trace: error: SYNCLESS_SYNC_CHECK='bogus' is not valid; allowed: off, warn, error, record; "
        "fix or unset it (`syncless doctor` lists every setting)"]


def test_a_bad_setting_stops_the_demo_before_any_stage_starts(monkeypatch, capsys):
    monkeypatch.setenv("SYNCLESS_PP_TIMEOUT_S", "-3")
    assert cli.main(["demo", "--cpu"]) == 2
    captured = capsys.readouterr()
    assert "syncless demo: error: SYNCLESS_PP_TIMEOUT_S='-3' is not valid" in captured.err
    assert captured.out == ""  # nothing started


def test_a_misspelt_name_is_warned_about_once():
    result = _syncless("--version", SYNCLESS_CC_MODE="on")
    assert result.stderr.strip().splitlines() == [
        "syncless: warning: SYNCLESS_CC_MODE is not a syncless setting and is ignored (did you mean SYNCLESS_CC?)"]


def test_an_unexpected_error_is_one_line_unless_debug(monkeypatch, capsys):
    from syncless import doctor

    def broken(args):
        raise RuntimeError("probe exploded\nsecond line")

    monkeypatch.setattr(doctor, "run", broken)
    assert cli.main(["doctor"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["syncless doctor: error: RuntimeError: probe exploded",
                                "syncless doctor: run with --debug (or SYNCLESS_DEBUG=1) for the traceback"]
    with pytest.raises(RuntimeError, match="probe exploded"):
        cli.main(["--debug", "doctor"])
    monkeypatch.setenv("SYNCLESS_DEBUG", "1")
    with pytest.raises(RuntimeError, match="probe exploded"):
        cli.main(["doctor"])


def test_a_failed_stage_is_reported_in_one_line_per_stage(monkeypatch, capsys):
    from syncless import doctor
    from syncless._core.launch import RankFailed

    def failing(args):
        raise RankFailed("run_stage: a rank failed:\n...", {1: "ValueError: bad shape\nTraceback (most recent...)"},
                         [0])

    monkeypatch.setattr(doctor, "run", failing)
    assert cli.main(["doctor"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "syncless doctor: error: stage 1: ValueError: bad shape"
    assert err[1] == "syncless doctor: stages [0] were stopped after that"
    assert not any("Traceback" in line for line in err)
    assert err[2:] == ["syncless doctor: run with --debug (or SYNCLESS_DEBUG=1) for the traceback"]


@pytest.mark.parametrize("error, story", [
    ("syncless", None),  # a message written for the user: no traceback says more
    ("killed", "exited with code -9 without a result"),
])
def test_no_debug_hint_after_an_error_that_has_no_traceback_worth_reading(monkeypatch, capsys, error, story):
    """#28 item 8: `bench cc` on a CPU said "needs a CUDA GPU", then "run with --debug ... for the traceback"."""
    from syncless import doctor
    from syncless._core.errors import MissingDependencyError
    from syncless._core.launch import RankFailed

    def failing(args):
        if story is None:
            raise MissingDependencyError("syncless bench cc needs a CUDA GPU")
        raise RankFailed("run_stage: a rank failed", {1: story}, [0])

    monkeypatch.setattr(doctor, "run", failing)
    assert cli.main(["doctor"]) == 1
    err = capsys.readouterr().err
    assert "--debug" not in err and err.startswith("syncless doctor: error: ")


def test_an_unknown_benchmark_is_named_as_the_user_sees_it(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "foo"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument BENCHMARK: invalid choice: 'foo'" in err and "which" not in err


@pytest.mark.parametrize("command, defaults", [
    ("demo", ["(default: 600)", "(default: 32 on GPUs, 8 on the CPU)", "(default: large on GPUs, tiny on the CPU)"]),
    ("bench", ["(default: bench-out)", "(default: off)"]),
    ("doctor", ["(default: text)"]),
])
def test_help_shows_the_defaults(command, defaults, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in defaults:
        assert default in text


def _children(pid):
    """PIDs whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _is_alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_long_demo():
    process = subprocess.Popen([sys.executable, "-m", "syncless", "demo", "--cpu", "--steps", "100000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                               start_new_session=True)
    deadline = time.monotonic() + 90
    stages = []
    while time.monotonic() < deadline and len(stages) < 2:
        time.sleep(0.5)
        stages = [pid for pid in _children(process.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    if len(stages) < 2:
        process.kill()
        pytest.fail(f"the demo did not start its two stages within 90 s: {process.communicate(timeout=30)}")
    time.sleep(2.0)  # into the decode loop
    return process, stages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how, status, line", [
    ("sigterm", 143, "syncless demo: terminated; every process it started was stopped"),
    ("ctrl-c", 130, "syncless demo: interrupted; every process it started was stopped"),
    ("sigkill", -9, None),
])
def test_stopping_the_demo_stops_its_stages(how, status, line):
    process, stages = _start_long_demo()
    try:
        if how == "sigterm":
            process.send_signal(signal.SIGTERM)
        elif how == "ctrl-c":
            os.killpg(process.pid, signal.SIGINT)  # what a terminal sends: the whole process group
        else:
            process.kill()
        out, err = process.communicate(timeout=60)
        assert process.returncode == status, err
        if line is not None:
            assert err.strip().splitlines()[-1] == line
            assert "Traceback" not in err
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_is_alive(pid) for pid in stages):
            time.sleep(0.2)
        assert not [pid for pid in stages if _is_alive(pid)], f"stage processes outlived the demo ({how})"
    finally:
        for pid in stages:
            if _is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()


def test_debug_works_after_the_subcommand_too(monkeypatch):
    from syncless import doctor

    def broken(args):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(doctor, "run", broken)
    with pytest.raises(RuntimeError, match="probe exploded"):
        cli.main(["doctor", "--debug"])


def _kill_rank_one(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does
    time.sleep(30 if rank == 0 else 0)
    return rank


def test_a_killed_stage_is_said_to_be_killed_by_a_signal_without_a_traceback_to_look_for(monkeypatch, capsys):
    """#28 item 6: "exited with code -9 without a result", then advice to read a traceback that does not exist."""
    from syncless import doctor
    from syncless._core.launch import run_ranks

    monkeypatch.setattr(doctor, "run", lambda args: run_ranks(_kill_rank_one, 2, timeout_s=60, load_by_file=True))
    assert cli.main(["doctor"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("syncless doctor: error: stage 1: killed by signal 9 (SIGKILL: out of memory?) without a "
                      "result; a killed process leaves no traceback")
    assert not any("--debug" in line for line in err)


@pytest.mark.parametrize("argv, line", [
    (["demo", "--stpes", "3"], "syncless demo: error: unrecognized arguments: --stpes 3 (see `syncless demo --help`)"),
    (["demo", "--steps", "0"],
     "syncless demo: error: argument --steps: must be at least 1, got 0 (see `syncless demo --help`)"),
    (["doctor", "--jsn"], "syncless doctor: error: unrecognized arguments: --jsn (see `syncless doctor --help`)"),
    (["--bogus"], "syncless: error: unrecognized arguments: --bogus (see `syncless --help`)"),
])
def test_a_usage_error_is_one_line_naming_the_subcommand_and_its_help(argv, line, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == line + "\n"  # no usage block before it, and not the top level's
    assert captured.out == ""

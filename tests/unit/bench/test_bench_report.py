"""The shared report writer: goal verdicts, cell formatting, markdown and JSON (CPU only)."""

import json
import math

import pytest

from syncless.bench._report import BenchOutput, Goal, format_value, render_markdown, run_metadata, write_output

META = {"date_utc": "2026-12-01 00:00:00", "command": "syncless bench x", "host": "h", "platform": "p",
        "python": "3.12", "torch": "2.11", "cuda": "13.0", "gpus": []}


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_a_goal_is_met_exactly_at_its_target(higher_is_better):
    assert Goal("at the target", 0.95, 0.95, higher_is_better=higher_is_better).met


def test_a_goal_is_missed_just_past_its_target_or_without_a_value():
    assert not Goal("bandwidth", 0.9499, 0.95, higher_is_better=True).met
    assert not Goal("latency", 0.8501, 0.85).met
    assert not Goal("no value", math.nan, 1.0).met
    assert not Goal("no value", math.nan, 1.0, higher_is_better=True).met


def test_goal_as_dict_carries_the_verdict():
    missed = Goal("kernel with a receive pending", 2.5, 1.05).as_dict()
    assert missed == {"description": "kernel with a receive pending", "measured": 2.5, "target": 1.05, "unit": "x",
                      "higher_is_better": False, "met": False}
    assert Goal("bandwidth", 1.2, 1.1, "x", True).as_dict()["met"] is True


@pytest.mark.parametrize("value, text", [(math.nan, "n/a"), (12345.6, "12,346"), (999.6, "1,000"), (100.0, "100"),
                                         (99.94, "99.9"), (0.012345, "0.0123"), (7, "7"), ("ours", "ours")])
def test_format_value(value, text):
    assert format_value(value) == text


def test_markdown_shows_each_goal_direction_and_verdict():
    output = BenchOutput(name="x", title="Some bench", goals=[
        Goal("bandwidth", 1.2, 1.1, "x", higher_is_better=True),
        Goal("latency", 0.9, 0.85, "x"),
    ])
    markdown = render_markdown(output, META)
    assert markdown.startswith("## Some bench\n")
    assert "| bandwidth | 1.2 x | >= 1.1 x | met |" in markdown
    assert "| latency | 0.9 x | <= 0.85 x | MISSED |" in markdown


def test_written_files_carry_goals_notes_and_a_top_level_heading(tmp_path):
    output = BenchOutput(name="x", title="Some bench", data={"k": 1}, notes=["first note", "second note"],
                         tables=[("numbers", ["a", "b"], [[1.5, math.nan]])],
                         goals=[Goal("latency", 0.9, 0.85, "x")])
    paths = write_output(output, tmp_path, META)
    assert set(paths) == {"json", "md"}  # no plot, no PNG
    document = json.loads(paths["json"].read_text())
    assert document["meta"] == META and document["data"] == {"k": 1}
    assert document["goals"][0]["met"] is False
    assert document["notes"] == ["first note", "second note"]
    markdown = paths["md"].read_text()
    assert markdown.startswith("# Some bench\n")
    assert "| 1.5 | n/a |" in markdown
    assert "\n- first note\n- second note\n" in markdown


@pytest.mark.parametrize("argv, command", [
    (["/venv/bin/syncless", "bench", "pp"], "syncless bench pp"),
    (["/venv/lib/python3.12/site-packages/syncless/__main__.py", "bench", "cc"], "syncless bench cc"),
    (["/home/me/run_it.py", "--quick"], "/home/me/run_it.py --quick"),
])
def test_metadata_names_the_command_as_typed(monkeypatch, argv, command):
    monkeypatch.setattr("sys.argv", argv)
    assert run_metadata()["command"] == command


def test_without_matplotlib_the_json_and_markdown_are_written_and_say_how_to_get_the_plot(tmp_path, monkeypatch):
    from syncless.bench import _report

    def plot(path):
        raise AssertionError("the plot must not be drawn without matplotlib")

    monkeypatch.setattr(_report, "is_plotting_available", lambda: False)
    output = _report.BenchOutput(name="syncs", title="Syncs", tables=[("t", ["a"], [[1]])], plot=plot)
    paths = _report.write_output(output, tmp_path, meta={"gpus": [], "date_utc": "d", "host": "h", "torch": "t",
                                                         "python": "p", "command": "c"})
    assert set(paths) == {"json", "md"}
    text = paths["md"].read_text()
    assert "pip install 'syncless[bench]'" in text and "syncs.png" not in text


def test_bench_all_on_the_cpu_runs_what_it_can_and_writes_a_report(tmp_path, monkeypatch, capsys):
    import sys
    import types

    from syncless import cli
    from syncless._core.errors import MissingDependencyError
    from syncless.bench import _cli, _report

    def fine(args, progress):
        return _report.BenchOutput(name="syncs", title="Syncs", tables=[("t", ["a"], [[1]])])

    def needs_gpu(args, progress):
        raise MissingDependencyError("syncless bench cc needs a CUDA GPU")

    modules = {"m_syncs": types.SimpleNamespace(run=fine), "m_cc": types.SimpleNamespace(run=needs_gpu)}
    monkeypatch.setattr(_cli, "BENCHMARKS", {"syncs": "m_syncs", "cc": "m_cc"})
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    assert cli.main(["bench", "all", "--quick", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "## Syncs" in report and "- cc: skipped, syncless bench cc needs a CUDA GPU" in report
    # Asked for by name, the same benchmark is an error of one line.
    assert cli.main(["bench", "cc", "--out", str(tmp_path)]) == 1
    assert "syncless bench: error: syncless bench cc needs a CUDA GPU" in capsys.readouterr().err


def test_an_out_path_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    from syncless import cli

    target = tmp_path / "file"
    target.write_text("x")
    assert cli.main(["bench", "syncs", "--out", str(target)]) == 2
    assert f"--out {target} is a file, not a directory" in capsys.readouterr().err

"""The SYNCLESS_* registry: defaults, parsing, and errors that name variable, value and allowed values."""

import pytest

from syncless._core import config
from syncless._core.errors import ConfigError


def test_every_setting_has_a_valid_default_and_doc():
    for decl in config.settings():
        assert decl.name.startswith("SYNCLESS_")
        assert decl.doc and decl.allowed
        decl.parse(decl.default)  # the default itself must be allowed


def test_defaults_apply_when_unset():
    assert config.read("SYNCLESS_SYNC_CHECK", {}) == "off"
    assert config.read("SYNCLESS_CC", {}) == "auto"
    assert config.read("SYNCLESS_PP_TIMEOUT_S", {}) == 60.0
    assert config.read("SYNCLESS_REQUIRE_GPU", {}) is False
    assert config.read("SYNCLESS_CC_MAX_STAGED_BYTES", {}) == 64 << 20


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("SYNCLESS_SYNC_CHECK", "Record", "record"),
        ("SYNCLESS_CC", " emulate ", "emulate"),
        ("SYNCLESS_PP_TRANSPORT", "copy_engine", "copy_engine"),
        ("SYNCLESS_PP_TIMEOUT_S", "2.5", 2.5),
        ("SYNCLESS_REQUIRE_GPU", "yes", True),
        ("SYNCLESS_REQUIRE_GPU", "1", True),  # what the GPU test runs set
        ("SYNCLESS_REQUIRE_GPU", "0", False),
        ("SYNCLESS_REQUIRE_GPU", "", False),  # set but empty reads as off
        ("SYNCLESS_CC_MAX_STAGED_BYTES", "1GiB", 1 << 30),
        ("SYNCLESS_CC_MAX_STAGED_BYTES", "4096", 4096),
        ("SYNCLESS_CC_MAX_STAGED_BYTES", "8k", 8192),
    ],
)
def test_valid_values_parse(name, text, expected):
    assert config.read(name, {name: text}) == expected


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("SYNCLESS_SYNC_CHECK", "loud"),
        ("SYNCLESS_CC", "maybe"),
        ("SYNCLESS_PP_TRANSPORT", "nccl"),
        ("SYNCLESS_PP_TIMEOUT_S", "-1"),
        ("SYNCLESS_PP_TIMEOUT_S", "0"),  # a zero timeout would fail every wait at once
        ("SYNCLESS_PP_TIMEOUT_S", "inf"),  # no timeout at all is what the setting exists to prevent
        ("SYNCLESS_PP_TIMEOUT_S", "nan"),
        ("SYNCLESS_PP_TIMEOUT_S", "soon"),
        ("SYNCLESS_REQUIRE_GPU", "sometimes"),
        ("SYNCLESS_CC_MAX_STAGED_BYTES", "12 parsecs"),
        ("SYNCLESS_CC_MAX_STAGED_BYTES", "-5"),
    ],
)
def test_bad_values_name_variable_value_and_allowed(name, text):
    with pytest.raises(ConfigError) as info:
        config.read(name, {name: text})
    message = str(info.value)
    assert name in message
    assert repr(text) in message
    assert config.setting(name).allowed in message
    assert isinstance(info.value, ValueError)


def test_every_registered_variable_rejects_garbage():
    for decl in config.settings():
        with pytest.raises(ConfigError, match=decl.name):
            config.read(decl.name, {decl.name: "\x00garbage\x00"})


def test_explicit_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("SYNCLESS_CC", "on")
    assert config.resolve("SYNCLESS_CC") == "on"
    assert config.resolve("SYNCLESS_CC", "off") == "off"
    monkeypatch.setenv("SYNCLESS_REQUIRE_GPU", "1")
    assert config.resolve("SYNCLESS_REQUIRE_GPU", False) is False  # a falsy explicit value still wins


def test_unknown_syncless_variable_is_rejected_by_validate_all():
    with pytest.raises(ConfigError, match="SYNCLESS_CC_MODE is not a syncless setting"):
        config.validate_all({"SYNCLESS_CC_MODE": "on"})
    config.validate_all({"SYNCLESS_CC": "off", "PATH": "/bin"})


def test_validate_all_rejects_a_bad_value_of_a_known_variable():
    with pytest.raises(ConfigError, match=r"SYNCLESS_PP_TIMEOUT_S='soon' is not valid"):
        config.validate_all({"SYNCLESS_CC": "off", "SYNCLESS_PP_TIMEOUT_S": "soon"})


def test_effective_reports_source_and_errors_without_raising():
    rows = {row["name"]: row for row in config.effective({"SYNCLESS_CC": "bogus", "SYNCLESS_PP_TIMEOUT_S": "5"})}
    assert rows["SYNCLESS_CC"]["error"] and "bogus" in rows["SYNCLESS_CC"]["error"]
    assert rows["SYNCLESS_PP_TIMEOUT_S"] == {**rows["SYNCLESS_PP_TIMEOUT_S"], "value": 5.0, "source": "env", "error": None}
    assert rows["SYNCLESS_SYNC_CHECK"]["source"] == "default"
    empty = {row["name"]: row for row in config.effective({"SYNCLESS_REQUIRE_GPU": ""})}["SYNCLESS_REQUIRE_GPU"]
    assert empty["source"] == "env" and empty["value"] is False  # set to "" is still set


def test_unknown_name_lookup_lists_known_names():
    with pytest.raises(KeyError, match="SYNCLESS_CC"):
        config.setting("SYNCLESS_NOPE")


@pytest.mark.parametrize("typo, meant", [
    ("SYNCLESS_CC_MODE", "SYNCLESS_CC"),
    ("SYNCLESS_SYNC_CHEK", "SYNCLESS_SYNC_CHECK"),
    ("SYNCLESS_PP_TIMEOUT", "SYNCLESS_PP_TIMEOUT_S"),
    ("SYNCLESS_PP_TRANSPORTS", "SYNCLESS_PP_TRANSPORT"),
])
def test_a_misspelt_name_is_found_with_the_one_meant(typo, meant):
    assert config.unknown_names({typo: "x", "SYNCLESS_CC": "off", "PATH": "/bin"}) == [(typo, meant)]
    assert f"did you mean {meant}?" in config.describe_unknown(typo, meant)


def test_a_name_close_to_nothing_lists_the_known_ones():
    (name, closest), = config.unknown_names({"SYNCLESS_ZZZZZZZZZZZZZZZZZZZZZZ": "1"})
    assert closest is None
    assert "known: SYNCLESS_SYNC_CHECK" in config.describe_unknown(name, closest)


def test_a_misspelt_name_is_warned_about_once_per_process(caplog):
    from syncless._core.logs import forget_logged

    forget_logged("unknown-setting:")
    environ = {"SYNCLESS_CC_MODE": "on"}
    with caplog.at_level("WARNING", logger="syncless"):
        first = config.warn_unknown_names(environ)
        second = config.warn_unknown_names(environ)
    assert first == ["SYNCLESS_CC_MODE is not a syncless setting and is ignored (did you mean SYNCLESS_CC?)"]
    assert second == []
    assert [r.getMessage() for r in caplog.records] == [f"syncless: warning: {first[0]}"]


def test_invalid_values_lists_every_bad_value_and_never_raises():
    problems = config.invalid_values({"SYNCLESS_CC": "bogus", "SYNCLESS_PP_TIMEOUT_S": "-1", "SYNCLESS_DEBUG": "1"})
    assert len(problems) == 2
    assert problems[0].startswith("SYNCLESS_CC='bogus' is not valid")
    assert config.invalid_values({}) == []


@pytest.mark.parametrize("name", ["SYNCLESS_FOO", "SYNCLESS_X", "SYNCLESS_PP", "SYNCLESS_BAR_BAZ"])
def test_a_name_close_to_no_setting_gets_no_suggestion(name):
    # Every name shares SYNCLESS_: that prefix alone made SYNCLESS_FOO "close" to SYNCLESS_CC (issue #28).
    assert config.closest_name(name) is None
    assert "did you mean" not in config.describe_unknown(name, config.closest_name(name))


@pytest.mark.parametrize("typo, meant", [("SYNCLESS_DEBUGG", "SYNCLESS_DEBUG"), ("SYNCLESS_CCC", "SYNCLESS_CC"),
                                         ("SYNCLESS_TIMEOUT_S", "SYNCLESS_PP_TIMEOUT_S")])
def test_a_close_name_is_still_suggested(typo, meant):
    assert config.closest_name(typo) == meant


def test_a_misspelt_name_is_warned_about_once_however_many_ranks_start():
    """The ranks run_ranks spawns import syncless before parent_process() is set: they must stay quiet (#28)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[3] / "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNCLESS_")}
    env.update(PYTHONPATH=src, SYNCLESS_PP_TIMEOUT="5")
    code = "import operator\nfrom syncless._core.launch import run_ranks\nprint(run_ranks(operator.add, 3, timeout_s=60))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.stdout.strip() == "[3, 4, 5]", result.stderr
    warnings = [line for line in result.stderr.splitlines() if "SYNCLESS_PP_TIMEOUT is not a syncless setting" in line]
    assert len(warnings) == 1, result.stderr

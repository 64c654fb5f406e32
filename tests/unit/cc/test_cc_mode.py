"""Mode resolution and SYNCLESS_CC validation."""

import pytest

from syncless._core.errors import ConfigError, MissingDependencyError
from syncless.cc import _detect


def _probe(answer):
    calls = []

    def probe():
        calls.append(1)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return probe, calls


@pytest.mark.parametrize("requested", ["on", "off", "emulate", " ON ", "Emulate"])
def test_explicit_modes_never_ask_nvml(requested):
    probe, calls = _probe(True)
    decision = _detect.resolve_mode(requested, probe)
    assert decision.mode == requested.strip().lower()
    assert calls == []


@pytest.mark.parametrize(("answer", "expected"), [(True, "on"), (False, "off")])
def test_auto_follows_nvml(answer, expected):
    probe, calls = _probe(answer)
    decision = _detect.resolve_mode("auto", probe)
    assert (decision.mode, decision.requested, len(calls)) == (expected, "auto", 1)
    assert "NVML" in decision.reason


def test_auto_without_nvml_is_off_with_reason():
    probe, _ = _probe(MissingDependencyError("nvidia-ml-py is not installed"))
    decision = _detect.resolve_mode("auto", probe)
    assert decision.mode == "off"
    assert "nvidia-ml-py is not installed" in decision.reason


@pytest.mark.parametrize("bad", ["yes", "", "emulated", "1"])
def test_bad_mode_names_allowed_values(bad):
    with pytest.raises(ValueError, match="auto, on, off, emulate"):
        _detect.validate_mode(bad)


def test_non_string_mode_is_type_error():
    with pytest.raises(TypeError, match="str"):
        _detect.validate_mode(1)


def test_env_is_validated(monkeypatch):
    monkeypatch.setenv("SYNCLESS_CC", "sometimes")
    with pytest.raises(ConfigError, match="SYNCLESS_CC='sometimes'.*auto, on, off, emulate"):
        _detect.decide_mode()


@pytest.mark.parametrize("value", ["auto", "on", "off", "emulate"])
def test_env_accepts_every_mode(monkeypatch, value):
    monkeypatch.setenv("SYNCLESS_CC", value)
    monkeypatch.setattr(_detect, "ask_nvml_for_cc", lambda: False)
    assert _detect.decide_mode().requested == value


def test_explicit_beats_env(monkeypatch):
    monkeypatch.setenv("SYNCLESS_CC", "emulate")
    assert _detect.cc_mode("off") == "off"
    monkeypatch.setenv("SYNCLESS_CC", "off")
    assert _detect.cc_mode("on") == "on"
    assert _detect.cc_mode() == "off"


def test_is_confidential_compute_is_false_where_nvml_cannot_answer(monkeypatch):
    """Issue 35 item 11: without a driver it raised MissingDependencyError (an ImportError), where vLLM's platform
    check returns False; a port's ``except RuntimeError`` missed it."""
    from syncless._core import cuda as _cuda
    from syncless._core.errors import MissingDependencyError

    def no_nvml():
        raise MissingDependencyError("nvidia-ml-py is not installed (stand-in)")

    monkeypatch.setattr(_cuda, "ensure_nvml", no_nvml)
    assert _detect.is_confidential_compute() is False
    with pytest.raises(MissingDependencyError):
        _detect.ask_nvml_for_cc()  # the raising form, for decide_mode("auto") and doctor's reason
    assert "NVML could not be asked" in _detect.decide_mode("auto").reason
